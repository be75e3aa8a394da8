"""Block heads (DFlash, DSpark) in the speculative runtime: one forward's drafts equal the training-mode
block at that anchor, greedy speculative decoding reproduces the target's own tokens, sampling emits the
target's distribution, and eagle-eval drafts blocks."""

import json

import pytest
import torch
from conftest import TINY_BLOCK, tiny_head, tiny_target
from test_eval import recount_al
from test_peagle_runtime import V, confident_target
from test_runtime_sampling import chi_square_rejects

from eagle_cli.evaluate import main
from eagle_train.hidden_states import target_hidden_states
from eagle_train.methods.block.head import num_drafts
from inference.block_drafting import BlockDrafter
from inference.drafting import TreeShape
from inference.generate import Runtime
from inference.sampling import Sampler

BLOCK = dict(init_std=0.2, draft_ids=None, draft_vocab_size=V, mask_token_id=V - 1)  # over the confident target
CASES = {  # tiny heads of each kind, sized like the confident target
    "dflash": dict(TINY_BLOCK["dflash"], **BLOCK),
    "dflash-causal": dict(TINY_BLOCK["dflash"], causal=True, **BLOCK),
    "dspark": dict(TINY_BLOCK["dspark"], **BLOCK),
    # the published recipe: the mask slots embed by the target's row mask_token_id, the drafts read its lm_head
    "dflash-target": dict(TINY_BLOCK["dflash"], block_mask="target", block_lm_head="target", **BLOCK),
    "dspark-target": dict(TINY_BLOCK["dspark"], block_mask="target", block_lm_head="target", **BLOCK),
    # speculators' training default: causal blocks over a sliding window of the context (shorter than the prompt)
    "dflash-window": dict(TINY_BLOCK["dflash"], causal=True, sliding_window=5, **BLOCK),
}


def block_head(case, model):
    return tiny_head(case.split("-")[0], seed=1, target_model=model, **CASES[case]).eval()


class Recorder(BlockDrafter):
    """Keeps every round's (committed length, block outputs [1, K, H], chain tokens) for the consistency check;
    with `padded` every catch-up after the prefill goes through the fixed-size path CUDA graphs replay."""

    padded = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rounds, self.length = [], None

    def catch_up(self, aux, next_ids, start):
        if self.padded and start > 0:
            return self.catch_up_padded(aux, next_ids, start)
        return super().catch_up(aux, next_ids, start)

    def block(self, anchor, positions, mask, cache):
        (h,) = super().block(anchor, positions, mask, cache)
        self.rounds.append([int(positions[0]), h.clone()])
        return (h,)

    def draft(self, root_token, h_root, logits_root, length):
        tree = super().draft(root_token, h_root, logits_root, length)
        self.rounds[-1].append(tree.tokens.tolist())
        return tree


def runtime_with(model, head, k, padded=False):
    rt = Runtime(model, head, TreeShape.chain(k), cuda_graphs=False)
    assert type(rt.drafter) is BlockDrafter  # the runtime drafts block heads in blocks by itself
    rt.drafter = Recorder(head, TreeShape.chain(k), rt.sampler)
    rt.drafter.padded = padded
    return rt


def check_rounds_against_training(head, model, prompt, output_ids, rounds, k):
    """Each round's block outputs equal `forward_blocks` at anchor L (the pending token x_L, the target's states
    before L), and its chain is the argmax of `draft_logits` over them, each reading the draft before it."""
    full = torch.cat([torch.as_tensor(prompt), torch.tensor(output_ids)])[None]
    aux, _ = target_hidden_states(model, full)
    for length, h, tokens in rounds:
        with torch.no_grad():
            expected = head.forward_blocks(aux, full, torch.tensor([[length]]))[0, 0, head.draft_slots()][:k]
            logits, _ = head.draft_logits(expected, torch.tensor(tokens[:-1]))
        assert h.shape == (1, k, expected.shape[-1])
        torch.testing.assert_close(h[0], expected, rtol=1e-4, atol=1e-5)
        assert tokens[0] == int(full[0, length])  # the chain's root is the pending token
        assert head.draft_to_target_ids(logits.argmax(-1)).tolist() == tokens[1:], length


@pytest.mark.parametrize("case", CASES)
def test_block_drafts_equal_training_outputs_and_greedy_is_exact(case):
    model = confident_target()
    head = block_head(case, model)
    k = num_drafts(head.config)
    prompt = torch.randint(0, V, (9,), generator=torch.Generator().manual_seed(0)).tolist()
    rt = runtime_with(model, head, k)
    spec = rt.generate(prompt, 32)
    plain = rt.generate_plain(prompt, 32)
    assert spec.output_ids == plain.output_ids  # lossless
    assert sum(spec.accepted) > 0 and spec.forwards < plain.forwards  # accepted drafts save target forwards
    assert sum(spec.emitted) == plain.forwards  # every token but the prefill's from a verification
    assert len(rt.drafter.rounds) == spec.forwards >= 3
    check_rounds_against_training(head, model, prompt, spec.output_ids, rt.drafter.rounds, k)


@pytest.mark.parametrize("case", ["dflash", "dspark"])
def test_drafts_stay_consistent_when_whole_chains_are_accepted_through_the_padded_catch_up(case):
    """Force every draft to be accepted (not lossless; it exercises catch-ups of K+1 rows) and catch up through
    the fixed-size path: each round still equals the training-mode block, at K below the block's drafts too."""
    model = tiny_target(seed=2, vocab_size=V, num_hidden_layers=5, max_position_embeddings=256, rope_theta=1e4)
    head = block_head(case, model)
    for k in (num_drafts(head.config), 2):
        rt = runtime_with(model, head, k, padded=True)

        def accept_all(tree, logits, k=k):
            return list(range(1, k + 1)), int(logits[k].argmax()), tree.tokens.tolist()

        rt.accept = accept_all
        prompt = list(range(2, 9))
        out = rt.generate(prompt, 3 * (k + 1) + 1)
        lengths = [length for length, *_ in rt.drafter.rounds]
        assert lengths == [7 + i * (k + 1) for i in range(3)]
        check_rounds_against_training(head, model, prompt, out.output_ids, rt.drafter.rounds, k)


@torch.no_grad()
def exact_second_and_third(model, prompt, sampler):
    """The target's own joint distribution of the 2nd and 3rd new tokens under `sampler`'s warping."""

    def probs(ids):
        return sampler.probs(model(torch.tensor([prompt + ids])).logits[0, -1])

    v = model.config.vocab_size
    joint = torch.zeros(v, v)
    for a, pa in enumerate(probs([])):
        for b, pb in enumerate(probs([a])):
            joint[b] += pa * pb * probs([a, b])
    return joint


def assert_emits_the_target_distribution(generate, model, prompt, sampler):
    """2000 runs of `generate()` (3 new tokens after `prompt`, sampled with `sampler`): drafts are accepted, the 2nd
    and 3rd tokens fit the target's own joint distribution, and a hotter sampler's is rejected (the test has power)."""
    counts, accepted = torch.zeros(model.config.vocab_size, model.config.vocab_size), 0
    for _ in range(2000):
        out = generate()
        counts[out.output_ids[1], out.output_ids[2]] += 1
        accepted += sum(out.accepted)
    assert accepted > 300  # the drafts matter
    assert not chi_square_rejects(counts, exact_second_and_third(model, prompt, sampler))
    hot = Sampler(temperature=1.3, top_k=5, top_p=0.97)
    assert chi_square_rejects(counts, exact_second_and_third(model, prompt, hot))


# 2000 generations of a tiny model: about 15 s on the 2-core CPU
def test_speculative_sampling_with_dsparks_markov_bias_emits_the_target_distribution():
    """Draft 2 is drawn with the Markov bias of the sampled draft 1, from the distribution acceptance divides by:
    the tokens a round emits (accepted drafts or corrections) follow the target's own distribution."""
    model = tiny_target(seed=0, vocab_size=6, num_hidden_layers=3, max_position_embeddings=64, rope_theta=1e4)
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
    options = {**TINY_BLOCK["dspark"], "block_size": 2, "mask_token_id": 3, "draft_vocab_size": 5}
    head = tiny_head("dspark", seed=0, target_model=model, draft_ids=[0, 1, 2, 4, 5], **options).eval()
    with torch.no_grad():
        head.markov_head.markov_w1.mul_(10)  # a bias that moves draft 2 with draft 1
    prompt = [1, 4, 2, 0, 5]
    sampler = Sampler(temperature=0.9, top_k=5, top_p=0.97)
    runtime = Runtime(model, head, TreeShape.chain(2), sampler, seed=0)
    assert_emits_the_target_distribution(lambda: runtime.generate(prompt, 3), model, prompt, sampler)


@pytest.mark.parametrize("case", ["dflash", "dspark"])
def test_sampling_drafts_blocks_within_the_vocabulary(case):
    model = confident_target()
    head = block_head(case, model)
    runtime = Runtime(model, head, None, Sampler(temperature=0.8, top_p=0.95), seed=0)
    out = runtime.generate(list(range(2, 9)), 40)
    assert len(out.output_ids) == 40 and all(0 <= t < V for t in out.output_ids)
    assert sum(out.accepted) > 0 and max(out.accepted) <= num_drafts(head.config)


def test_more_drafts_than_a_block_gives_or_a_tree_is_refused():
    model = confident_target()
    head = block_head("dflash", model)
    with pytest.raises(ValueError, match="drafts at most 3 tokens a forward: use --parallel K with 1 <= K <= 3"):
        BlockDrafter(head, TreeShape.chain(4), Sampler())
    with pytest.raises(ValueError, match="draft a chain"):
        BlockDrafter(head, TreeShape(2, 2, 3), Sampler())


@pytest.fixture(scope="module")
def tiny_block_head_dir(tiny_llama, tmp_path_factory):
    """An untrained DSpark head (block of 4: 4 drafts) for the tiny Llama, saved."""
    path = tmp_path_factory.mktemp("tiny-block-head")
    options = {**TINY_BLOCK["dspark"], "mask_token_id": 0, "draft_vocab_size": 2000}
    head = tiny_head("dspark", init_std=None, draft_ids=None, target_model=tiny_llama[0], **options)
    head.save_pretrained(path)
    return path


def eval_args(tiny_llama_dir, head_dir, out, *more):
    return [
        "--target",
        str(tiny_llama_dir),
        "--draft",
        str(head_dir),
        "--bench",
        "gsm8k",
        "--num-prompts",
        "1",
        "--max-new-tokens",
        "8",
        "--out",
        str(out),
        *more,
    ]


@pytest.mark.parametrize("more, k", [((), 4), (("--parallel", "2"), 2)])
def test_eval_drafts_blocks(tiny_llama_dir, tiny_block_head_dir, tmp_path, more, k):
    out = tmp_path / "results.json"
    main(eval_args(tiny_llama_dir, tiny_block_head_dir, out, *more))
    saved = json.loads(out.read_text())
    assert saved["title"].startswith(f"gsm8k: 1 prompts, block (DSpark) K={k}, temperature 0.0")
    assert saved["drafting"]["block"] and saved["drafting"]["depth"] == k and not saved["drafting"]["parallel"]
    assert saved["summary"]["acceptance_length"] == pytest.approx(recount_al(saved), abs=1e-12)
    assert saved["summary"]["turns_identical_to_plain"] == 1  # greedy: spec == plain
    assert len(saved["summary"]["acceptance_per_position"]) == k


@pytest.mark.parametrize(
    "args, message",
    [
        (["--parallel", "5"], "DSpark head with block_size 4 drafts at most 4 tokens a forward"),
        (["--tree", "2,2,3"], "holds a DSpark head, which drafts a chain: use --parallel K, not --tree"),
    ],
)
def test_eval_refuses_what_a_block_head_cannot_draft(tiny_llama_dir, tiny_block_head_dir, tmp_path, args, message):
    with pytest.raises(SystemExit, match=message):
        main(eval_args(tiny_llama_dir, tiny_block_head_dir, tmp_path / "r.json", *args))


@pytest.mark.parametrize("case,k", [("dflash", 3), ("dspark", 4)])
def test_block_walk_over_the_greedy_text_is_what_the_runtime_accepts(case, k):
    """On the target's own greedy text, `block_loss.block_walk` runs the rounds greedy block drafting runs: as many
    verifications, emitting as many tokens, as `Runtime.generate` (quality.py's walk for block heads)."""
    from eagle_train.hidden_states import TargetLogits
    from eagle_train.methods.block.loss import block_walk

    model, head = few_token_pair(case)
    accepted = []
    for i in range(3):
        prompt = torch.randint(0, V, (4 + 3 * i,), generator=torch.Generator().manual_seed(i)).tolist()
        spec = Runtime(model, head, TreeShape.chain(k)).generate(prompt, 40)
        seq = torch.tensor([prompt + spec.output_ids])
        # the answer up to where the last round starts: that round's drafts may run past the 40 tokens kept
        last_start = len(prompt) + sum(a + 1 for a in spec.accepted[:-1])
        loss_mask = torch.zeros_like(seq, dtype=torch.bool)
        loss_mask[0, len(prompt) : last_start + 1] = True
        with torch.no_grad():
            aux, final = target_hidden_states(model, seq, aux_layer_ids=head.config.aux_layer_ids)
        sample = {"input_ids": seq[0], "loss_mask": loss_mask[0], "aux_hidden": aux[0], "final_hidden": final[0]}
        rounds = spec.accepted[:-1]
        assert block_walk(head, [sample], TargetLogits.of(model), k) == (sum(rounds) + len(rounds), len(rounds))
        accepted += spec.accepted
    assert sum(accepted) > 5 and max(accepted) == k  # drafts were accepted, whole blocks too: the walk jumped


def few_token_pair(case):
    """The confident target and a block head whose logits are 0 but for tokens 0 and 1 (target, head and Markov
    bias alike): both pick among tokens 0, 1 and 2, so drafts are right about half the time and whole blocks
    are accepted now and then."""
    model = confident_target()
    head = block_head(case, model)
    with torch.no_grad():
        for weight in [model.lm_head.weight, head.lm_head.weight] + (
            [head.markov_head.markov_w2] if head.config.markov_rank else []
        ):
            weight[2:] = 0
    return model, head
