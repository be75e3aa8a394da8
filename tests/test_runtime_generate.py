"""Greedy speculative decoding is lossless: token for token the target's own greedy output."""

import pytest
import torch
from conftest import EagerStep, load_script, tiny_pair

from eagle_train.methods.eagle3.head import Eagle3Head
from inference.drafting import TreeShape
from inference.evaluate import chat_ids, load_bench
from inference.generate import Runtime
from inference.llama import TargetModel

V, VD = 16, 12
# A tiny Llama with a 16-token vocabulary, confident (lm_head x 20), and a random head over 12 of those
# tokens: random drafts are accepted often enough to exercise multi-token acceptance and tree compaction.
PAIR = dict(
    draft_vocab_size=VD,
    lm_head_scale=20,
    init_std=0.2,
    vocab_size=V,
    num_hidden_layers=5,
    max_position_embeddings=256,
    rope_theta=10000.0,
)


@torch.no_grad()
def hf_greedy(model, prompt, n):
    """The target's greedy tokens from plain HF forwards over the whole sequence (no cache)."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt) :]


def hf_generate(model, prompt, n, eos):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    return out[0, len(prompt) :].tolist()


def noisy_oracle(runtime, true_seq):
    """Replace the draft logits of `runtime` by a noisy oracle of the target's greedy continuation
    `true_seq` (the head still runs, so its cache is written as usual): at a position whose input
    token is on the true path the oracle ranks the true next token first, second, or nowhere,
    depending on the position. Drafts get accepted 0..K at a time and tree paths leave the first
    branch."""
    drafter = runtime.drafter
    head = drafter.head
    t2d_index = torch.cumsum(head.t2d.long(), 0) - 1  # target id -> draft id where t2d

    def oracle(logits, ids, pos):  # logits [n, Vd] of the tokens ids [n] at positions pos [n]
        logits = torch.zeros_like(logits)
        for r, (token, p) in enumerate(zip(ids.tolist(), pos.tolist())):
            if p + 2 < len(true_seq) and token == true_seq[p + 1] and head.t2d[true_seq[p + 2]]:
                true_draft = t2d_index[true_seq[p + 2]]
                mode = (p * 7) % 5
                logits[r, true_draft] = {0: 5.0, 1: 5.0, 2: 5.0, 3: 3.0, 4: -5.0}[mode]
                logits[r, (true_draft + 1) % VD] = 4.0  # the wrong favourite when mode 3
        return logits

    real_step = drafter.step_fn

    def step(hidden, ids, pos, cache, slots, mask):  # tree expansions
        h, logits = real_step(hidden, ids, pos, cache, slots, mask)
        return h, oracle(logits[0], ids[0], pos[0])[None]

    def catching_up(real):  # the root: the last catch-up row
        def wrapped(aux, next_ids, start):
            h, logits = real(aux, next_ids, start)
            n = next_ids.shape[1]
            return h, oracle(logits[None], next_ids[0, -1:], torch.tensor([start + n - 1]))[0]

        return wrapped

    step.reset = getattr(real_step, "reset", None)  # a GraphedStep's, under CUDA graphs
    drafter.step_fn = step
    drafter.catch_up, drafter.catch_up_padded = catching_up(drafter.catch_up), catching_up(drafter.catch_up_padded)


@pytest.mark.parametrize(
    "shape",
    [TreeShape.chain(1), TreeShape.chain(4), TreeShape(3, 3, 8), TreeShape(4, 2, 6)],
    ids=["chain1", "chain4", "tree3-3-8", "tree4-2-6"],
)
def test_tiny_greedy_speculative_equals_target_greedy(shape, monkeypatch):
    model, head = tiny_pair(**PAIR)
    compactions = []
    real = TargetModel.compact
    monkeypatch.setattr(TargetModel, "compact", lambda self, s, d: (compactions.append(1), real(self, s, d)))
    accepted = 0
    for i in range(4):
        prompt = torch.randint(0, V, (3 + 5 * i,)).tolist()
        reference = hf_greedy(model, prompt, 30)
        runtime = Runtime(model, head, shape)
        noisy_oracle(runtime, prompt + reference)
        spec = runtime.generate(prompt, 30)
        plain = runtime.generate_plain(prompt, 30)
        assert spec.output_ids == plain.output_ids == reference, i
        assert len(spec.output_ids) == 30 and spec.forwards == len(spec.emitted)
        assert sum(spec.emitted) == 29  # every token but the prefill's comes from a verification
        assert all(1 <= e <= shape.depth + 1 for e in spec.emitted)
        accepted += sum(spec.accepted)
    assert accepted > 15 * min(shape.depth, 2)  # drafts really were accepted, several at a time
    if not shape.is_chain:
        assert compactions  # accepted paths left the first branch


def test_draft_cache_holds_step0_entries_of_the_committed_sequence():
    """After generation the head's cache equals one catch-up over the whole committed sequence
    with the target's hidden states: every round fed the right aux states, tokens and positions."""
    from eagle_train.hidden_states import target_hidden_states

    model, head = tiny_pair(2, **PAIR)
    prompt = torch.randint(0, V, (9,)).tolist()
    runtime = Runtime(model, head, TreeShape(3, 2, 5))
    noisy_oracle(runtime, prompt + hf_greedy(model, prompt, 24))
    spec = runtime.generate(prompt, 24)
    assert sum(spec.accepted) > 3
    committed = len(prompt) + sum(spec.emitted[:-1])  # the last round ends before its catch-up
    seq = torch.tensor([prompt + spec.output_ids])
    with torch.no_grad():
        aux, _ = target_hidden_states(model, seq[:, :committed])
        cache = head.new_cache(1, committed)
        pos = torch.arange(committed)
        head.step(
            head.fc(aux), seq[:, 1 : committed + 1], pos[None], cache, pos, (pos[None, :] <= pos[:, None])[None, None]
        )
    got = runtime.drafter.cache
    assert (got.k[:, :, :committed] - cache.k).abs().max() < 1e-5
    assert (got.v[:, :, :committed] - cache.v).abs().max() < 1e-5


def test_eos_stops_generation_and_is_emitted():
    model, head = tiny_pair(1, **PAIR)
    prompt = [3, 1, 4, 1, 5]
    free = Runtime(model, head, TreeShape.chain(3)).generate(prompt, 20).output_ids
    eos = free[7]
    first = free.index(eos)
    for runtime in (
        Runtime(model, head, TreeShape.chain(3), eos_token_ids=[eos]),
        Runtime(model, head, TreeShape(3, 2, 5), eos_token_ids=[eos]),
    ):
        assert runtime.generate(prompt, 20).output_ids == free[: first + 1]
        assert runtime.generate_plain(prompt, 20).output_ids == free[: first + 1]


@pytest.fixture(scope="module")
def smollm2_random_head(smollm2):
    torch.manual_seed(0)
    model, tokenizer = smollm2
    return model, tokenizer, Eagle3Head.from_target(model).eval()


def bench_prompt_ids(tokenizer, bench, num):
    return [chat_ids(tokenizer, [{"role": "user", "content": p["turns"][0]}]) for p in load_bench(bench, num)]


@pytest.fixture(scope="module")
def smollm2_greedy_reference(smollm2):
    """One prompt of each bench and HF generate's greedy continuations (32 tokens; the CPU is slow)."""
    model, tokenizer = smollm2
    prompts = [ids for bench in ("mt_bench", "humaneval", "gsm8k") for ids in bench_prompt_ids(tokenizer, bench, 1)]
    return [(p, hf_generate(model, p, 32, tokenizer.eos_token_id)) for p in prompts]


@pytest.mark.parametrize("shape", [TreeShape.chain(3), TreeShape(2, 4, 6)], ids=["chain3", "tree2-4-6"])
def test_smollm2_random_head_greedy_is_lossless(smollm2_random_head, smollm2_greedy_reference, shape):
    model, tokenizer, head = smollm2_random_head
    runtime = Runtime(model, head, shape, eos_token_ids=[tokenizer.eos_token_id])
    forwards = emitted = 0
    for prompt, reference in smollm2_greedy_reference:
        spec = runtime.generate(prompt, 32)
        assert spec.output_ids == reference
        forwards, emitted = forwards + spec.forwards, emitted + sum(spec.emitted)
    assert 1.0 <= emitted / forwards < 1.15  # a random head is (almost) never right


@pytest.mark.slow
@pytest.mark.parametrize("bench", ["mt_bench", "humaneval", "gsm8k"])
def test_smollm2_every_bench_prompt_lossless(smollm2_random_head, bench):
    model, tokenizer, head = smollm2_random_head
    chain = Runtime(model, head, TreeShape.chain(3), eos_token_ids=[tokenizer.eos_token_id])
    tree = Runtime(model, head, TreeShape(3, 4, 10), eos_token_ids=[tokenizer.eos_token_id])
    for prompt in bench_prompt_ids(tokenizer, bench, None):
        plain = chain.generate_plain(prompt, 48).output_ids
        assert chain.generate(prompt, 48).output_ids == plain
        assert tree.generate(prompt, 48).output_ids == plain


def test_runtime_without_head_refuses_speculation():
    model, _ = tiny_pair(**PAIR)
    with pytest.raises(ValueError, match="no draft head"):
        Runtime(model).generate([1, 2, 3], 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_equal_eager_and_target_greedy():
    model, head = tiny_pair(**PAIR)
    prompt = torch.randint(0, V, (11,)).tolist()
    reference = hf_greedy(model, prompt, 40)
    model, head = model.cuda(), head.cuda()
    for shape in (TreeShape.chain(3), TreeShape(3, 3, 8)):
        graphed = Runtime(model, head, shape, cuda_graphs=True)
        eager = Runtime(model, head, shape, cuda_graphs=False)
        noisy_oracle(graphed, prompt + reference)
        noisy_oracle(eager, prompt + reference)
        assert graphed.use_graphs and not eager.use_graphs
        for runtime in (graphed, eager):
            spec = runtime.generate(prompt, 40)
            assert spec.output_ids == reference and sum(spec.accepted) > 10
            assert runtime.generate_plain(prompt, 40).output_ids == reference
        assert graphed.generate(prompt, 40).output_ids == reference  # replayed graphs, second prompt


def test_fixed_shape_path_of_cuda_graphs_is_lossless_on_cpu():
    """The shapes CUDA graphs replay (full-cache attention widths, caches rounded up to 256 slots),
    run eagerly on the CPU: same tokens as the target's greedy decoding."""
    model, head = tiny_pair(3, **PAIR)
    prompt = torch.randint(0, V, (13,)).tolist()
    reference = hf_greedy(model, prompt, 30)
    runtime = Runtime(model, head, TreeShape(3, 3, 8))
    runtime.use_graphs = True  # the steps stay eager: only the fixed shapes are exercised

    drafter = runtime.drafter
    runtime.target_step, drafter.step_fn, drafter.layer_fn = (
        EagerStep(f) for f in (runtime.target_step, drafter.step_fn, drafter.layer_fn)
    )
    noisy_oracle(runtime, prompt + reference)
    spec = runtime.generate(prompt, 30)
    assert runtime.target.max_len == 256 and spec.output_ids == reference and sum(spec.accepted) > 10
    assert runtime.generate_plain(prompt, 30).output_ids == reference


@pytest.mark.parametrize("k", [1, 3])
def test_chain_walk_over_the_greedy_text_is_what_the_runtime_accepts(k):
    """On the target's own greedy text, `ttt.chain_walk` (`chain_rounds` over the TTT steps' top-1 agreement) runs
    the rounds greedy chain drafting runs: as many verifications, emitting as many tokens, as `Runtime.generate`;
    sample by sample (quality.py's walk, scripts/bench/sampled_acceptance.py's) and in the trainer's eval, whose
    objective walks a padded batch of the same samples (its metrics give chain_al)."""
    from eagle_train.hidden_states import TargetLogits, target_hidden_states
    from eagle_train.methods.eagle3.ttt import chain_walk, ttt_loss
    from eagle_train.training_parts import target_distribution

    sampled = load_script("bench/sampled_acceptance.py")

    model, head = tiny_pair(3, **PAIR)
    per_round, samples, runs = [], [], []
    for i in range(4):
        prompt = torch.randint(0, V, (4 + 3 * i,)).tolist()
        spec = Runtime(model, head, TreeShape.chain(k)).generate(prompt, 40)
        seq = torch.tensor([prompt + spec.output_ids])
        loss_mask = torch.zeros_like(seq, dtype=torch.bool)
        loss_mask[0, len(prompt) :] = True
        with torch.no_grad():
            aux, final = target_hidden_states(model, seq, aux_layer_ids=head.config.aux_layer_ids)
        # every round but a last one cut at 40 tokens emits its accepted drafts + 1
        assert sum(spec.accepted) + spec.forwards >= sum(spec.emitted) == len(spec.output_ids) - 1
        runtime = (sum(spec.accepted) + spec.forwards, spec.forwards)
        sample = {"input_ids": seq[0], "loss_mask": loss_mask[0], "aux_hidden": aux[0], "final_hidden": final[0]}
        assert chain_walk(head, [sample], TargetLogits.of(model), k) == runtime, i
        draft_ids = head.draft_to_target_ids(torch.arange(head.config.draft_vocab_size))
        _, walk, _ = sampled.acceptance(head, draft_ids, TargetLogits.of(model), sample, [0.0], k)
        assert walk == runtime, i
        per_round += spec.accepted
        samples.append(sample)
        runs.append(runtime)
    assert sum(per_round) > 10 and max(per_round) == k  # drafts were accepted, whole chains too: the walk jumped
    total = tuple(map(sum, zip(*runs)))
    assert chain_walk(head, samples, TargetLogits.of(model), k) == total

    def padded(key):  # right padding, as the trainer batches
        rows = [s[key] for s in samples]
        return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)

    batch = {key: padded(key) for key in samples[0]}
    with torch.no_grad():
        probs, in_draft = target_distribution(batch["final_hidden"], TargetLogits.of(model), head.t2d)
        _, metrics = ttt_loss(
            head, batch["aux_hidden"], batch["input_ids"], batch["loss_mask"], probs, in_draft, ttt_length=k
        )
    assert (int(metrics["count_chain_tokens"]), int(metrics["count_rounds"])) == total
