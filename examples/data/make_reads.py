"""Regenerate `reads.fastq`: 200 synthetic DNA reads of 24-40 bases (seeded, so the file is identical every time).

python examples/data/make_reads.py
"""

import random
from pathlib import Path


def make_reads(num_reads: int = 200, seed: int = 0) -> str:
    rng = random.Random(seed)
    records = []
    for i in range(num_reads):
        length = rng.randint(24, 40)
        # Mostly ACGT, with an occasional N (an uncalled base), as in real reads.
        seq = "".join(rng.choices("ACGTN", weights=[25, 25, 25, 25, 1], k=length))
        # Phred+33 qualities: 'I' (40) for good calls, '#' (2) for N.
        qual = "".join("#" if base == "N" else chr(33 + rng.randint(20, 40)) for base in seq)
        records.append(f"@read{i:03d}\n{seq}\n+\n{qual}\n")
    return "".join(records)


if __name__ == "__main__":
    out = Path(__file__).resolve().parent / "reads.fastq"
    out.write_text(make_reads())
    print(f"wrote {out}")
