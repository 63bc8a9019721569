"""
Tiny mixture-of-experts LMs that return their router logits (`CASES`): Mixtral (4 experts, top 2, every layer
sparse) and Qwen3-MoE (2 layers, the first dense), with a large router coefficient so that a router term taken over the
wrong rows shows in the loss and the gradient. Their rows are the matrix's causal LM rows (uneven lengths, padding
masked out by the attention mask, which the router loss honours too).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from tests.helpers.heads import Case, lm_rows
from tests.helpers.tiny import tiny

ROUTER_COEF = 0.5


def _mixtral(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    config = tiny(
        MixtralConfig,
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=ROUTER_COEF,
    )
    return MixtralForCausalLM(config)


def _qwen3_moe(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    config = tiny(
        Qwen3MoeConfig,
        num_hidden_layers=2,
        mlp_only_layers=[0],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        output_router_logits=True,
        router_aux_loss_coef=ROUTER_COEF,
        head_dim=8,
    )
    return Qwen3MoeForCausalLM(config)


CASES = {case.name: case for case in (Case("mixtral_moe", _mixtral, lm_rows), Case("qwen3_moe", _qwen3_moe, lm_rows))}
