"""Record which target architectures the installed vLLM serves EAGLE-3 heads on, into
engines/vllm_eagle3_targets.json: what `eagle-export --check --engine vllm --target T` reads where vLLM is not
installed. Run it in an environment with vLLM (bash scripts/install_vllm.sh) after changing vLLM's version."""

from engines.vllm import EAGLE3_TARGETS, list_eagle3_targets

if __name__ == "__main__":
    list_eagle3_targets(EAGLE3_TARGETS)
    print(f"wrote {EAGLE3_TARGETS}")
