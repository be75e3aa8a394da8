"""Running llama.cpp's tools on one prompt and reading what they measured (`LlamaCppRun`).

`run_plain`, `run_head` and `run_ngram` decode one chat-templated prompt greedily and return what
llama.cpp measured; a head GGUF drafts as its file says (`drafting`): EAGLE-3 chains (draft-eagle3) or a
DFlash / DSpark block a round (draft-dflash, draft-dspark: K at most the block's drafts). The free types
(`free_types`: ngram-simple, ngram-map-k, ngram-mod, ngram-cache) draft without a head, and comma-separated
types combine (`hybrid_flags`): llama.cpp tries them in its own order, the n-gram types first, and a round
takes the first that drafts (common/speculative.cpp). How its
counters become forwards: every round of llama-speculative-simple runs
[last token, drafts...] through the target in one forward and adds the tokens it keeps (accepted
drafts + the target's own) to n_predict and the accepted drafts to n_accept, so
forwards = n_predict - n_accept. The prompt but its last token is decoded before the loop and
generates nothing; its last token rides in the first round. Plain decoding generates one token per
forward, the first from the prompt's. (Targets whose cache cannot drop rejected drafts, recurrent
ones, redo a partially accepted round from a checkpoint; llama.cpp does not count those redos.)
"""

import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from eagle_train.export.gguf import ARCHS, BLOCK_ARCH, field_value, gguf_arch
from eagle_train.unreadable import HEAD_FIX, open_gguf
from engines.llamacpp_build import LlamaCppError, require_tools, tail


@dataclass
class LlamaCppRun:
    """One greedy decode of one prompt, as llama.cpp counted and timed it."""

    text: str  # the new text (an end-of-generation token is not printed)
    eos: bool | None  # stopped at an end-of-generation token (plain runs; llama-speculative-simple does not say)
    prompt_tokens: int  # the prompt as llama.cpp tokenized it
    tokens: int  # new tokens, an end-of-generation token included
    forwards: int  # target forwards that generated them
    drafted: int
    accepted: int
    decoded: int  # tokens generated inside llama.cpp's timed decode span ...
    seconds: float  # ... and its length (plain: eval time, the prompt's forward out; speculative: the whole loop)
    target_seconds: float  # all the target's forwards by its perf counters, the prompt's included

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens / self.forwards if self.forwards else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.decoded / self.seconds if self.seconds else 0.0


def counter(pattern: str, stderr: str, tool: str) -> tuple[str, ...]:
    match = re.search(pattern, stderr)
    if match is None:
        raise LlamaCppError(f"{tool} printed no {pattern!r} line; its stderr ends:\n{tail(stderr)}")
    return match.groups()


def parse_speculative(stdout: str, stderr: str, prompt: str) -> LlamaCppRun:
    """llama-speculative-simple's output: stdout = "\\n\\n" + prompt + new text + "\\n\\n\\n\\n", counters on stderr."""
    tool = "llama-speculative-simple"
    n_input, _ = counter(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds", stderr, tool)
    n_predict, seconds = counter(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", stderr, tool)
    (drafted,) = counter(r"n_drafted\s*=\s*(\d+)", stderr, tool)
    (accepted,) = counter(r"n_accept\s*=\s*(\d+)", stderr, tool)
    # the target context's perf lines (the draft's print empty): the prompt, then every verification
    batched_ms, _ = counter(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens", stderr, tool)
    single_ms, _ = counter(r"common_perf_print:\s+eval time =\s*([\d.]+) ms /\s*(\d+) runs", stderr, tool)
    if not stdout.endswith("\n\n\n\n"):
        raise LlamaCppError(f"{tool}'s stdout was cut short: {stdout[-200:]!r}")
    start = stdout.find(prompt)  # after "\n\n" and, for a target that adds one, the BOS token's text
    if start < 0:
        raise LlamaCppError(f"{tool} did not echo the prompt as given; its stdout begins {stdout[:200]!r}")
    tokens = int(n_predict)
    return LlamaCppRun(
        text=stdout[start + len(prompt) : -4],
        eos=None,
        prompt_tokens=int(n_input),
        tokens=tokens,
        forwards=tokens - int(accepted),
        drafted=int(drafted),
        accepted=int(accepted),
        decoded=tokens,
        seconds=float(seconds),
        target_seconds=(float(batched_ms) + float(single_ms)) / 1000,
    )


def parse_completion(stdout: str, stderr: str) -> LlamaCppRun:
    """llama-completion's output (--no-display-prompt): the new text [+ " [end of text]\\n"] + "\\n\\n",
    its perf counters on stderr. Every eval run but the prompt's generates one token."""
    tool = "llama-completion"
    prompt_ms, prompt_tokens = counter(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens", stderr, tool)
    ms, runs = counter(r"common_perf_print:\s+eval time =\s*([\d.]+) ms /\s*(\d+) runs", stderr, tool)
    if not stdout.endswith("\n\n"):
        raise LlamaCppError(f"{tool}'s stdout was cut short: {stdout[-200:]!r}")
    tokens = int(runs) + 1
    text = stdout[:-2].removesuffix(" [end of text]\n")
    return LlamaCppRun(
        text=text,
        eos=len(text) < len(stdout) - 2,
        prompt_tokens=int(prompt_tokens),
        tokens=tokens,
        forwards=tokens,
        drafted=0,
        accepted=0,
        decoded=int(runs),
        seconds=float(ms) / 1000,
        target_seconds=(float(prompt_ms) + float(ms)) / 1000,
    )


def run_tool(tool: str, args: list, prompt: str, threads: int | None) -> tuple[str, str]:
    """Run a tool on `prompt` (passed byte for byte: -bf, no escapes) greedily; returns (stdout, stderr)."""
    with tempfile.TemporaryDirectory() as tmp:
        prompt_file = Path(tmp) / "prompt.txt"
        prompt_file.write_bytes(prompt.encode())
        cmd = [require_tools() / tool, *args, "-bf", prompt_file, "--no-escape", "--temp", "0", "--color", "off"]
        if threads:
            cmd += ["-t", threads]
        done = subprocess.run([str(c) for c in cmd], capture_output=True)
    stdout, stderr = done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace")
    if done.returncode != 0:
        raise LlamaCppError(f"{tool} failed (exit {done.returncode}); its stderr ends:\n{tail(stderr)}")
    return stdout, stderr


def same_text(plain: LlamaCppRun, drafted: LlamaCppRun) -> bool:
    """Whether a speculative run wrote plain decoding's text: the same text if plain stopped at an
    end-of-generation token, else plain's text continued (speculative runs may overshoot by k tokens)."""
    return drafted.text == plain.text if plain.eos else drafted.text.startswith(plain.text)


def run_plain(target, prompt: str, n: int, threads: int | None = None) -> LlamaCppRun:
    """Plain greedy decoding of up to `n` new tokens (llama-completion)."""
    args = ["-m", target, "-n", n, "-no-cnv", "--no-display-prompt"]
    return parse_completion(*run_tool("llama-completion", args, prompt, threads))


def run_speculative(target, prompt: str, n: int, spec: list, threads: int | None) -> LlamaCppRun:
    """The loop stops once it has more than -n tokens and drafts no further than the budget left, except
    that a budget of 0 means unbounded: -n n-1 gives n to n+k tokens (fewer at an end-of-generation token)."""
    args = ["-m", target, "-n", n - 1, *spec]
    return parse_speculative(*run_tool("llama-speculative-simple", args, prompt, threads), prompt)


@dataclass
class Drafting:
    """How llama-speculative-simple drafts with a head GGUF: its --spec-type and the most drafts a round."""

    spec_type: str
    max_drafts: int | None  # a block head's drafts per block (None: EAGLE-3 chains of any length)

    def flags(self, k: int) -> list:
        return ["--spec-type", self.spec_type, "--spec-draft-n-max", min(k, self.max_drafts or k)]


def drafting(head) -> Drafting:
    """What the file says it is: a dflash file drafts as draft-dspark where it has the Markov head or drafts
    from the anchor's slot (llama.cpp's default for DSpark when the key is absent), up to block_size drafts,
    else as draft-dflash, up to block_size - 1 (the anchor's slot drafts nothing); an eagle3 file as draft-eagle3;
    a model of any other architecture is a draft model (draft-simple). A file that does not read as a GGUF goes as
    draft-eagle3, and llama.cpp says why it cannot load it."""
    try:
        arch = gguf_arch(head)
    except (OSError, ValueError, KeyError, IndexError):
        return Drafting("draft-eagle3", None)
    if arch not in ARCHS:
        return Drafting("draft-simple", None)
    if arch != BLOCK_ARCH:
        return Drafting("draft-eagle3", None)
    reader = open_gguf(head, "draft GGUF", HEAD_FIX)  # gguf_arch's reader, parsed once

    def key(name, default):
        found = reader.fields.get(f"{BLOCK_ARCH}.{name}")
        return field_value(found) if found is not None else default

    markov = any(t.name == "markov_w1.weight" for t in reader.tensors)
    block_size, from_anchor = key("block_size", 16), key("sample_from_anchor", markov)
    if markov or from_anchor:
        return Drafting("draft-dspark", block_size if from_anchor else block_size - 1)
    return Drafting("draft-dflash", block_size - 1)


def head_flags(head, k: int) -> list:
    """A head GGUF drafting up to `k` tokens a round (`drafting`: EAGLE-3 chains, or a DFlash or DSpark block,
    `k` clamped to its drafts per block)."""
    return ["-md", head, *drafting(head).flags(k)]


def run_head(target, head, prompt: str, n: int, k: int, threads: int | None = None) -> LlamaCppRun:
    """Speculative decoding with a head GGUF (`head_flags`)."""
    return run_speculative(target, prompt, n, head_flags(head, k), threads)


NGRAM_KEY = 2  # the n-gram types' lookup length at their best here (docs/performance.md); their defaults, 12 to 24,
# rarely fire on a chat turn


def ngram_key(k: int) -> int:
    """ngram-simple drafts nothing when its draft length is below its lookup length: the key is at most K."""
    return min(k, NGRAM_KEY)


def ngram_simple_flags(k: int) -> list:
    """ngram-simple: the `k` tokens that followed the last n-gram's latest earlier occurrence, the n-gram
    `ngram_key(k)` tokens long."""
    return ["--spec-ngram-simple-size-n", ngram_key(k), "--spec-ngram-simple-size-m", k]


def free_types(k: int) -> dict[str, list]:
    """llama.cpp's drafting types that need no head, by the bench loop's drafter names, each with the flags that
    make it draft up to `k` tokens after a short key (ngram-cache takes no length: llama.cpp drafts up to 8)."""
    key = ngram_key(k)
    return {
        "ngram": ["--spec-type", "ngram-simple", *ngram_simple_flags(k)],
        "ngram-map-k": ["--spec-type", "ngram-map-k", "--spec-ngram-map-k-size-n", key, "--spec-ngram-map-k-size-m", k],
        "ngram-mod": [
            "--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", key, "--spec-ngram-mod-n-min", 1,
            "--spec-ngram-mod-n-max", k,
        ],
        "ngram-cache": ["--spec-type", "ngram-cache"],
    }  # fmt: skip


def hybrid_flags(head, k: int) -> list:
    """Head + n-gram: `--spec-type ngram-simple,<the head's type>`; llama.cpp drafts by ngram-simple where it
    finds a draft, else by the head."""
    found = drafting(head)
    return [
        "-md", head, "--spec-type", f"ngram-simple,{found.spec_type}", *ngram_simple_flags(k),
        "--spec-draft-n-max", min(k, found.max_drafts or k),
    ]  # fmt: skip


def run_ngram(target, prompt: str, n: int, k: int, threads: int | None = None) -> LlamaCppRun:
    """Speculative decoding without a head by ngram-simple (`ngram_simple_flags`), up to `k` drafts."""
    return run_speculative(target, prompt, n, free_types(k)["ngram"], threads)


def measure(target_gguf, head_gguf, prompts_text: list[str], k: int, n: int, threads: int | None = None) -> list:
    """Per templated prompt: the head's tokens per forward in llama.cpp and whether its greedy text is
    plain decoding's (what a live check of an exported head needs)."""
    results = []
    for prompt in prompts_text:
        plain = run_plain(target_gguf, prompt, n, threads)
        head = run_head(target_gguf, head_gguf, prompt, n, k, threads)
        results.append(
            {
                "tokens_per_forward": head.tokens_per_forward,
                "identical": same_text(plain, head),
                "plain": plain,
                "head": head,
            }
        )
    return results
