"""
The engines beside data parallelism: what hf_parallel needs to know of DeepSpeed (`deepspeed`: checks before its
engine starts, hand-written loops over an engine, sequence parallelism) and the saving of a model ZeRO-3 partitioned
(`zero3`). Nothing here imports deepspeed at import time; the functions import it when a run uses it.
"""
