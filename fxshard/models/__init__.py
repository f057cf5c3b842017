"""Reference models written in plain PyTorch (no parallel code): fxshard
parallelises them by graph rewriting."""
from . import llama
from .llama import LlamaConfig, LlamaForCausalLM

__all__ = ["llama", "LlamaConfig", "LlamaForCausalLM"]
