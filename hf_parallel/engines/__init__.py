"""
The engines beside data parallelism: what hf_parallel needs to know of DeepSpeed (`deepspeed`). Nothing here imports
deepspeed at import time; the functions import it when a run uses it.
"""
