"""The examples: examples/train.py, image_classification.py and speech_recognition.py train, save and reload;
examples/embed.py reads FASTQ/FASTA/text, chunks reads and gives the same embeddings from a real 2-process launch as
in one process."""

import gzip
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file

from examples import embed as embed_example
from examples.data import make_reads
from tests.helpers.paths import NO_GPUS, ROOT, repo_env
from tests.helpers.processes import run_together

READS = ROOT / "examples" / "data" / "reads.fastq"


# ---- examples/train.py ----


@pytest.mark.slow
def test_main_example_runs_and_reload_matches(tmp_path):
    out = tmp_path / "run"
    env = repo_env(HF_HUB_OFFLINE="1", **NO_GPUS)
    command = [sys.executable, str(ROOT / "examples" / "train.py"), "--output_dir", str(out), "--disable_tqdm", "True"]
    (result,), _ = run_together([command], tmp_path, env)
    assert f"Saved the model and tokenizer to {out}" in result.output
    assert "Reload check: from_pretrained gives the same logits" in result.output
    assert (out / "model.safetensors").is_file()
    assert (out / "tokenizer.json").is_file()
    keys = load_file(out / "model.safetensors").keys()
    assert not [k for k in keys if k.startswith("module.")]
    # The default run learns the synthetic task: accuracy well above chance.
    accuracy_lines = [line for line in result.output.splitlines() if line.strip().startswith("eval_accuracy")]
    assert accuracy_lines, result.output[-2000:]
    assert float(accuracy_lines[-1].split("=")[1]) >= 0.9


# ---- examples/image_classification.py and examples/speech_recognition.py ----


def _run_example(tmp_path: Path, name: str) -> tuple[str, Path]:
    """Run `examples/<name>.py` with its defaults, offline, on the CPU; return its output and its output folder."""
    out = tmp_path / "run"
    # One thread: on a shared 2-core machine, two threads per tiny op make these runs several times slower.
    env = repo_env(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", **NO_GPUS)
    script = ROOT / "examples" / f"{name}.py"
    command = [sys.executable, str(script), "--output_dir", str(out), "--disable_tqdm", "True"]
    (result,), _ = run_together([command], tmp_path, env)
    assert "Reload check: from_pretrained gives the same logits" in result.output
    keys = load_file(out / "model.safetensors").keys()
    assert not [k for k in keys if k.startswith("module.")]
    return result.output, out


@pytest.mark.slow
@pytest.mark.full  # an end-to-end example (~9 s): .ci/run runs the full step
def test_image_classification_example_learns_and_reload_matches(tmp_path):
    output, out = _run_example(tmp_path, "image_classification")
    assert f"Saved the model to {out}" in output
    accuracy_lines = [line for line in output.splitlines() if line.strip().startswith("eval_accuracy")]
    assert accuracy_lines, output[-2000:]
    # 3 classes: chance is 1/3; the default run reaches 0.97-1.0.
    assert float(accuracy_lines[-1].split("=")[1]) >= 0.9


@pytest.mark.slow
@pytest.mark.full  # an end-to-end example (~9 s): .ci/run runs the full step
def test_speech_recognition_example_loss_falls_and_reload_matches(tmp_path):
    output, out = _run_example(tmp_path, "speech_recognition")
    assert f"Saved the model and processor to {out}" in output
    assert (out / "vocab.json").is_file()  # the script also reloads the processor (Wav2Vec2Processor.from_pretrained)
    # "Eval loss: 3.2116 before training, 0.0768 after"
    (eval_line,) = [line for line in output.splitlines() if line.startswith("Eval loss:")]
    before, after = (float(part.split()[0]) for part in eval_line.removeprefix("Eval loss:").split(","))
    assert after < 0.5 * before, eval_line
    # "Train loss: 3.0925 first logged (step 10), 0.0361 last logged (step 250)"
    (train_line,) = [line for line in output.splitlines() if line.startswith("Train loss:")]
    first, last = (float(part.split()[0]) for part in train_line.removeprefix("Train loss:").split(","))
    assert last < first, train_line
    assert len([line for line in output.splitlines() if line.strip().startswith("truth:")]) == 3


# ---- examples/embed.py: reading, chunking, a real launch ----

FASTQ = "@r1\nACGTAC\n+\nIIIIII\n@r2\nGGN\n+r2\n#I#\n"


def _write(path: Path, text: str, gz: bool = False) -> Path:
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def test_read_fastq_fasta_text_plain_and_gzipped(tmp_path):
    read = embed_example.read_sequences
    assert read(_write(tmp_path / "a.fastq", FASTQ)) == ["ACGTAC", "GGN"]
    assert read(_write(tmp_path / "a.fq.gz", FASTQ, gz=True)) == ["ACGTAC", "GGN"]
    # gzip is found by its magic bytes even under a plain name; the format by the first character.
    assert read(_write(tmp_path / "reads", FASTQ, gz=True)) == ["ACGTAC", "GGN"]
    fasta = ">s1 first\nACGT\nacgt\n\n>s2\nNNA\n"
    assert read(_write(tmp_path / "a.fa", fasta)) == ["ACGTACGT", "NNA"]
    assert read(_write(tmp_path / "a.fasta.gz", fasta, gz=True)) == ["ACGTACGT", "NNA"]
    assert read(_write(tmp_path / "a.txt", "ACGT\n\nttga\n")) == ["ACGT", "TTGA"]
    assert read(_write(tmp_path / "x.fastq", FASTQ + "\n\n")) == ["ACGTAC", "GGN"]  # trailing blank lines


MALFORMED = {
    "header": ("@r1\nACGT\n+\nIIII\nr2\nACGT\n+\nIIII\n", r"line 5: expected a FASTQ header starting with '@'"),
    "plus": ("@r1\nACGT\n-\nIIII\n", r"line 3: expected the '\+' separator line"),
    "quality": ("@r1\nACGT\n+\nIIII\n@r2\nACGT\n+\nIII\n", r"line 8: the quality line has 3 characters.*line 6"),
    "truncated": ("@r1\nACGT\n+\nIIII\n@r2\nACGT\n", r"line 6: the file ends inside the record that starts on line 5"),
    "character": ("@r1\nAC1T\n+\nIIII\n", r"line 2: invalid character '1'"),
    "blank": ("@r1\nACGT\n+\nIIII\n\n@r2\nACGT\n+\nIIII\n", r"line 5: blank line inside the file"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_fastq_names_the_line(tmp_path, case):
    text, message = MALFORMED[case]
    path = _write(tmp_path / "bad.fastq", text)
    with pytest.raises(embed_example.SequenceFormatError, match=message) as info:
        embed_example.read_sequences(path)
    assert str(path) in str(info.value)


def _two_level_chunks(fastq_text: str, outer: int, inner: int) -> list[str]:
    """A two-level chunker (fixed-size pieces of the concatenated reads, each cut again), as the oracle."""
    import io

    def read_in_chunks(file_object, chunk_size):
        sequence = ""
        while True:
            identifier = file_object.readline()
            if not identifier:
                break
            sequence_line = file_object.readline().strip()
            file_object.readline()
            file_object.readline()
            sequence += sequence_line
            while len(sequence) >= chunk_size:
                yield sequence[:chunk_size]
                sequence = sequence[chunk_size:]
        if sequence:
            yield sequence

    true_chunks = []
    for m in read_in_chunks(io.StringIO(fastq_text), outer):
        true_chunks.extend(m[i : i + inner] for i in range(0, len(m), inner))
    return true_chunks


@pytest.mark.parametrize("chunk_size", [1, 7, 12, 64, 10_000])
def test_chunking_matches_two_level_chunker(tmp_path, chunk_size):
    text = READS.read_text()
    seqs = embed_example.read_sequences(READS)
    ours = embed_example.chunk_sequences(seqs, chunk_size)
    # Cutting at 80 x the chunk size, then at the chunk size, is the same as one cut at the chunk size.
    assert ours == _two_level_chunks(text, 80 * chunk_size, chunk_size)
    assert "".join(ours) == "".join(seqs)
    per_read = embed_example.chunk_sequences(seqs, chunk_size, per_read=True)
    assert per_read == [s[i : i + chunk_size] for s in seqs for i in range(0, len(s), chunk_size)]


def test_shipped_reads_are_what_the_script_makes():
    assert READS.read_text() == make_reads.make_reads()
    assert len(embed_example.read_sequences(READS)) == 200


@pytest.mark.full  # two processes launched for real (~6 s): .ci/run runs it in its own step
def test_example_real_launch_two_processes_equals_one(tmp_path, no_gpus):
    """`accelerate launch --multi_gpu --num_processes 2 examples/embed.py` on CPU == the same script in-process."""
    # On the CPU in both: with GPUs, the launch would start NCCL processes (two on one GPU fail) and the
    # in-process run would embed on a GPU.
    embed_example.main(["--output_file", str(tmp_path / "one.npy"), "--no_progress"])
    env = repo_env(OMP_NUM_THREADS="1", **NO_GPUS)
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    cmd += ["--main_process_port", "0", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    cmd += [str(ROOT / "examples" / "embed.py"), "--output_file", str(tmp_path / "two.npy"), "--no_progress"]
    # A launch: on a failure or a hang, every process is stopped and its output shown.
    (result,), _ = run_together([cmd], tmp_path, env)
    assert "on 2 process(es)" in result.output and result.output.count("Embedded") == 1
    one, two = np.load(tmp_path / "one.npy"), np.load(tmp_path / "two.npy")
    assert one.shape == two.shape == (101, 32)  # 200 reads, 6,438 bases, cut at 64
    np.testing.assert_allclose(two, one, atol=1e-5, rtol=0)
