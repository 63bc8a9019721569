"""`hf_parallel.launch.environment`: what a launcher says through the environment, read in one place, without
importing torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hf_parallel.launch.environment import (
    cpu_requested,
    launcher_variables,
    launcher_world_size,
    world_size_variable,
)
from hf_parallel.launch.validation import check_whole_number
from tests.helpers.paths import ROOT, repo_env


def test_world_size_comes_from_the_first_variable_set():
    assert launcher_world_size({}) == 1
    assert launcher_world_size({"WORLD_SIZE": " 4 "}) == 4
    assert launcher_world_size({"WORLD_SIZE": "", "OMPI_COMM_WORLD_SIZE": "3"}) == 3
    assert world_size_variable({"PMI_SIZE": "2"}) == "PMI_SIZE"
    assert world_size_variable({"WORLD_SIZE": "  "}) is None


@pytest.mark.parametrize(("value", "message"), [("two", "is not a whole number"), ("0", "must be >= 1")])
def test_a_bad_world_size_names_the_variable(value, message):
    with pytest.raises(ValueError, match=rf"WORLD_SIZE.*{message}"):
        launcher_world_size({"WORLD_SIZE": value})


@pytest.mark.parametrize(
    ("value", "expected"), [("1", True), ("yes", True), ("True", True), ("0", False), ("", False)]
)
def test_cpu_flag_is_read_as_accelerate_reads_it(value, expected):
    assert cpu_requested({"ACCELERATE_USE_CPU": value}) is expected


def test_a_cpu_flag_that_is_neither_names_the_value():
    with pytest.raises(ValueError, match="ACCELERATE_USE_CPU='maybe'"):
        cpu_requested({"ACCELERATE_USE_CPU": "maybe"})


def test_launcher_variables_are_those_set_in_order():
    environ = {"RANK": "1", "WORLD_SIZE": "2", "HOME": "/root"}
    assert launcher_variables(environ) == {"WORLD_SIZE": "2", "RANK": "1"}


def test_importing_it_costs_no_torch():
    code = "import sys, hf_parallel.launch.environment, hf_parallel.launch.validation; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=repo_env(), cwd=ROOT)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3", None])
def test_whole_number_check_names_the_option_and_value(bad):
    with pytest.raises(ValueError, match=rf"batch_size must be a whole number >= 0, got {bad!r}\."):
        check_whole_number("batch_size", bad)
    assert check_whole_number("batch_size", 3, minimum=1) == 3
