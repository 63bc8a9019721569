"""Embed DNA reads with a masked LM: one mean-pooled vector per chunk, in file order, on one or several processes.

Reads a FASTQ (plain or gzipped), a FASTA or a text file of sequences (one per line), cuts the sequences into
fixed-size chunks (12,282 bases fill a 2,048-token nucleotide transformer), tokenizes, embeds with
`hf_parallel.embed_dataset` and writes `(num_chunks, hidden)` to a .safetensors (tensor "embeddings") or .npy file.
With no arguments it embeds the shipped `examples/data/reads.fastq` (200 reads) with a tiny masked LM built from a
config and a character-level tokenizer built locally (nothing is downloaded; the weights are random, so the vectors
only show the pipeline works).

One process (CPU, or one GPU; several GPUs without a launcher use DataParallel):

    python examples/embed.py
    python examples/embed.py reads.fq.gz --model_name_or_path InstaDeepAI/nucleotide-transformer-500m-human-ref \
        --chunk_size 12282 --max_length 2048 --batch_size 8 --output_file embeddings.safetensors

DDP, one process per GPU (with several GPUs, accelerate switches to its multi-GPU launcher by itself):

    accelerate launch --num_processes 2 examples/embed.py
    torchrun --nproc_per_node 2 examples/embed.py

DDP over 2 CPU processes (gloo). On a machine without GPUs, a plain `accelerate launch --num_processes 2` starts a
single process (it prints "on 1 process(es)"); ask for the multi-process launcher explicitly, with the shipped config
or `--multi_gpu` (without GPUs, `embed_dataset` joins the processes on the CPU):

    accelerate launch --config_file hf_parallel/configs/cpu_ddp.yaml examples/embed.py
    accelerate launch --multi_gpu --num_processes 2 examples/embed.py
    torchrun --nproc_per_node 2 examples/embed.py

Every launch writes the same file (to float rounding): rows in chunk order, one per chunk.
"""

from __future__ import annotations

import argparse
import gzip
import io
import re
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from transformers import AutoModelForMaskedLM, AutoTokenizer, BertConfig, BertForMaskedLM, PreTrainedTokenizerFast

from hf_parallel import POOLING_METHODS, embed_dataset

DEFAULT_READS = Path(__file__).resolve().parent / "data" / "reads.fastq"
FORMATS = ("fastq", "fasta", "text")
EXTENSIONS = {".fastq": "fastq", ".fq": "fastq", ".fasta": "fasta", ".fa": "fasta", ".fna": "fasta", ".txt": "text"}
# IUPAC nucleotide codes plus gap symbols; anything else on a sequence line is a format error.
SEQUENCE_RE = re.compile(r"[A-Za-z*.\-]*")


class SequenceFormatError(ValueError):
    """A sequence file that does not follow its format; the message names the file, the line and the problem."""


def _open_text(path: Path) -> io.TextIOBase:
    # Gzip is recognised by its magic bytes, not the extension: `reads.fq` is sometimes gzipped and vice versa.
    with open(path, "rb") as raw:
        magic = raw.read(2)
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rt", encoding="utf-8", newline=None)
    return open(path, encoding="utf-8", newline=None)  # noqa: SIM115 (the caller closes it)


def detect_format(path: Path) -> str:
    """`fastq`, `fasta` or `text` from the extension (a `.gz` suffix is skipped), else from the first character."""
    suffixes = [s.lower() for s in path.suffixes if s.lower() != ".gz"]
    if suffixes and suffixes[-1] in EXTENSIONS:
        return EXTENSIONS[suffixes[-1]]
    with _open_text(path) as f:
        first = f.read(1)
    return {"@": "fastq", ">": "fasta"}.get(first, "text")


def parse_fastq(lines: Iterable[str], name: str = "<fastq>") -> Iterator[str]:
    """
    Yield the sequence of each FASTQ record (4 lines: `@id`, sequence, `+[id]`, quality of the same length).

    Raises `SequenceFormatError` naming the 1-based line number and what is wrong. Blank lines at the end are
    allowed; sequences wrapped over several lines are not (rare in FASTQ, and ambiguous with `@` quality lines).
    """
    record: list[tuple[int, str]] = []
    blank_tail = None
    for number, line in enumerate(lines, start=1):
        line = line.rstrip("\r\n")
        if not line.strip() and not record:
            blank_tail = blank_tail or number
            continue
        if blank_tail is not None:
            raise SequenceFormatError(
                f"{name}, line {blank_tail}: blank line inside the file (only allowed at the end)."
            )
        record.append((number, line))
        if len(record) < 4:
            continue
        (n_head, head), (n_seq, seq), (n_plus, plus), (n_qual, qual) = record
        record = []
        if not head.startswith("@"):
            raise SequenceFormatError(
                f"{name}, line {n_head}: expected a FASTQ header starting with '@', got {head[:40]!r} "
                "(is it FASTA? use --format fasta; or is a record missing a line above?)."
            )
        if not SEQUENCE_RE.fullmatch(seq):
            bad = next(c for c in seq if not SEQUENCE_RE.fullmatch(c))
            raise SequenceFormatError(f"{name}, line {n_seq}: invalid character {bad!r} in the sequence {seq[:40]!r}.")
        if not plus.startswith("+"):
            raise SequenceFormatError(
                f"{name}, line {n_plus}: expected the '+' separator line, got {plus[:40]!r} "
                "(multi-line FASTQ sequences are not supported)."
            )
        if len(qual) != len(seq):
            raise SequenceFormatError(
                f"{name}, line {n_qual}: the quality line has {len(qual)} characters, the sequence on line {n_seq} "
                f"has {len(seq)}; they must match."
            )
        yield seq
    if record:
        raise SequenceFormatError(
            f"{name}, line {record[-1][0]}: the file ends inside the record that starts on line {record[0][0]} "
            f"({len(record)} of its 4 lines; is the file truncated?)."
        )


def parse_fasta(lines: Iterable[str], name: str = "<fasta>") -> Iterator[str]:
    """Yield the sequence of each FASTA record (a `>` header, then sequence lines joined); blank lines are skipped."""
    parts: list[str] | None = None
    for number, line in enumerate(lines, start=1):
        line = line.strip()
        if not line or line.startswith(";"):
            continue
        if line.startswith(">"):
            if parts is not None:
                yield "".join(parts)
            parts = []
            continue
        if parts is None:
            raise SequenceFormatError(f"{name}, line {number}: sequence data before the first '>' header.")
        if not SEQUENCE_RE.fullmatch(line):
            bad = next(c for c in line if not SEQUENCE_RE.fullmatch(c))
            raise SequenceFormatError(f"{name}, line {number}: invalid character {bad!r} in the sequence.")
        parts.append(line)
    if parts is not None:
        yield "".join(parts)


def parse_text(lines: Iterable[str], name: str = "<text>") -> Iterator[str]:
    """Yield one sequence per non-blank line."""
    for number, line in enumerate(lines, start=1):
        line = line.strip()
        if not line:
            continue
        if not SEQUENCE_RE.fullmatch(line):
            bad = next(c for c in line if not SEQUENCE_RE.fullmatch(c))
            raise SequenceFormatError(f"{name}, line {number}: invalid character {bad!r} in the sequence.")
        yield line


def read_sequences(path: str | Path, fmt: str = "auto") -> list[str]:
    """All sequences of a FASTQ / FASTA / text file, plain or gzipped, upper-cased, in file order."""
    path = Path(path)
    if fmt == "auto":
        fmt = detect_format(path)
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not one of {FORMATS}.")
    parser = {"fastq": parse_fastq, "fasta": parse_fasta, "text": parse_text}[fmt]
    with _open_text(path) as f:
        return [seq.upper() for seq in parser(f, name=str(path))]


def chunk_sequences(sequences: Iterable[str], chunk_size: int, per_read: bool = False) -> list[str]:
    """
    Cut sequences into pieces of `chunk_size` characters, the last one shorter.

    By default the reads are concatenated in file order and the whole stream is cut, so a chunk may span two reads
    (cutting first at a multiple of `chunk_size`, e.g. 982,560 = 80 x 12,282, and then at `chunk_size` gives the
    same chunks; 12,282 bases are 2,047 6-mer tokens plus [CLS] for the nucleotide transformer's 2,048).
    `per_read=True` cuts each read on its own instead, so no chunk mixes two reads.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}.")
    streams = sequences if per_read else ["".join(sequences)]
    return [s[i : i + chunk_size] for s in streams for i in range(0, len(s), chunk_size)]


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per nucleotide (A, C, G, T, N; anything else is [UNK]), [CLS] ... [SEP] around each chunk."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {tok: i for i, tok in enumerate(specials + list("ACGTN"))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )


def tiny_masked_lm(tokenizer: PreTrainedTokenizerFast, max_length: int, seed: int) -> BertForMaskedLM:
    """A 2-layer BERT masked LM built from a config, with seeded random weights (identical on every process)."""
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=max(max_length, 8),
        pad_token_id=tokenizer.pad_token_id,
    )
    return BertForMaskedLM(config)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("input", nargs="?", default=str(DEFAULT_READS), help="FASTQ/FASTA/text file, plain or .gz.")
    parser.add_argument("--format", default="auto", choices=("auto", *FORMATS), help="Input format (auto: by name).")
    parser.add_argument(
        "--chunk_size", type=int, default=64, help="Characters per chunk (12282 fills a 2048-token NT)."
    )
    parser.add_argument("--per_read", action="store_true", help="Chunk each read alone (default: concatenated).")
    parser.add_argument("--model_name_or_path", default=None, help="A masked LM (hub id or folder); default: tiny.")
    parser.add_argument("--trust_remote_code", action="store_true", help="Allow the model's own code (e.g. NT v2).")
    parser.add_argument("--max_length", type=int, default=None, help="Truncate chunks to this many tokens.")
    parser.add_argument("--batch_size", type=int, default=16, help="Chunks per forward per process.")
    parser.add_argument("--pooling", default="mean", choices=POOLING_METHODS, help="How to pool token states.")
    parser.add_argument("--layer", type=int, default=-1, help="Which hidden_states entry to pool (-1: the last).")
    parser.add_argument("--output_file", default="outputs/embeddings.safetensors", help=".safetensors or .npy.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the tiny model's random weights.")
    parser.add_argument("--no_progress", action="store_true", help="No progress bar.")
    args = parser.parse_args(argv)
    if not Path(args.input).is_file():
        parser.error(f"input file {args.input!r} does not exist.")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        sequences = read_sequences(args.input, args.format)
    except SequenceFormatError as error:
        raise SystemExit(f"error: {error}") from None
    chunks = chunk_sequences(sequences, args.chunk_size, per_read=args.per_read)
    if not chunks:
        raise SystemExit(f"{args.input} holds no sequence.")

    if args.model_name_or_path:
        tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path, trust_remote_code=args.trust_remote_code)
        model = AutoModelForMaskedLM.from_pretrained(args.model_name_or_path, trust_remote_code=args.trust_remote_code)
        max_length = args.max_length or min(tokenizer.model_max_length, model.config.max_position_embeddings)
    else:
        tokenizer = char_tokenizer()
        max_length = args.max_length or args.chunk_size + 2  # the chunk plus [CLS] and [SEP]
        model = tiny_masked_lm(tokenizer, max_length, args.seed)

    # Tokenize without padding: each batch is padded to its own longest row, not every row to the model's maximum.
    encoded = tokenizer(chunks, truncation=True, max_length=max_length)
    dataset = [{key: encoded[key][i] for key in encoded} for i in range(len(chunks))]

    start = time.perf_counter()
    embeddings = embed_dataset(
        model,
        dataset,
        batch_size=args.batch_size,
        pooling=args.pooling,
        layer=args.layer,
        tokenizer=tokenizer,
        output_file=args.output_file,
        progress=not args.no_progress,
        metadata={
            "model": args.model_name_or_path or "tiny-bert-mlm",
            "input": Path(args.input).name,
            "chunk_size": args.chunk_size,
            "per_read": args.per_read,
            "pooling": args.pooling,
            "layer": args.layer,
        },
    )
    seconds = time.perf_counter() - start
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if embeddings is not None:  # the main process
        processes = torch.distributed.get_world_size() if distributed else 1
        print(
            f"Embedded {len(chunks)} chunks of <= {args.chunk_size} bases on {processes} process(es) in "
            f"{seconds:.2f} s: {tuple(embeddings.shape)} written to {args.output_file}"
        )
    if distributed:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
