"""Training with two processes (`accelerate launch` over gloo on the CPU): every shipped accelerate
config, two nodes on one machine, P-EAGLE's partitioned backward under DDP, and resume across
backends and process counts.

The reference is one process accumulating 2 micro-batches a step, from the same run config: the same
global batch as 2 processes x 1, so every 2-process run must reproduce its loss curve, its gradients
and its head (up to the order of float reductions).

The default run launches what nothing else guards: DDP against the reference, a resume into more
processes, two nodes (global, not local, ranks), P-EAGLE's segments under DDP and a divergence that
must stop both processes. Each ZeRO stage and the other resumes launch under `-m slow`; what a backend
refuses is read in-process from the environment `accelerate launch` sets."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import free_port
from safetensors.torch import load_file

from eagle_cli.train import run
from eagle_train.checkpoint import load_draft_head
from eagle_train.methods import method_of, objective_for
from eagle_train.train_checkpoint import check_resumable, newest_checkpoint
from eagle_train.train_config import load_train_config
from eagle_train.trainer import train

REPO = Path(__file__).resolve().parents[1]
LAUNCH = {
    "ddp": ["--multi_gpu", "--mixed_precision", "no"],
    "fsdp": ["--config_file", "configs/accelerate/fsdp.yaml"],
    "zero2": ["--config_file", "configs/accelerate/deepspeed_zero2.yaml"],
    "zero3": ["--config_file", "configs/accelerate/deepspeed_zero3.yaml"],
}
deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed (pip install -e '.[deepspeed]')"
)
two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="accelerate runs FSDP on GPUs only, and 2 processes need 2 GPUs"
)
BACKENDS = [
    "ddp",
    pytest.param("fsdp", marks=two_gpus),
    pytest.param("zero2", marks=[deepspeed, pytest.mark.slow]),
    pytest.param("zero3", marks=[deepspeed, pytest.mark.slow]),
]
RUN = [  # 6 single-sample micro-batches an epoch: 3 steps of 2 per epoch, 6 in all
    "ttt_length=3",
    "tokens_per_batch=64",
    "max_length=64",
    "num_epochs=2",
    "learning_rate=2e-3",
    "mixed_precision=no",  # fp32 on GPUs too, so layouts agree to float tolerance
    "warmup_steps=2",
    "eval_fraction=0",
    "report_to=none",
    "log_every=0",
    "seed=0",
]


def overrides(data_path, out, *extra) -> list[str]:
    return [f"data_path={data_path}", f"output_dir={out}", *RUN, *extra]


def one_process(data_path, out, *extra) -> dict:
    """The run in this process, 2 micro-batches accumulated per step."""
    cfg = load_train_config(None, overrides(data_path, out, "gradient_accumulation_steps=2", *extra))
    return train(cfg, method_of(cfg).build_head, objective_for(cfg))


def launch_command(backend: str, args: list[str], script="train_eagle3.py", machines=None) -> list[str]:
    """`accelerate launch` of 2 processes; machines = (rank, port) for one of 2 single-process nodes."""
    where = ["--num_machines", "1", "--main_process_port", str(free_port())]
    if machines is not None:
        rank, port = machines
        where = ["--num_machines", "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1"]
        where += ["--main_process_port", str(port), "--rdzv_backend", "static"]
    launch = [sys.executable, "-m", "accelerate.commands.launch", *LAUNCH[backend], "--num_processes", "2"]
    return [*launch, *where, "--dynamo_backend", "no", str(REPO / "scripts" / script), *args]


# every launch: from the repository (the DeepSpeed configs name their JSON relative to it), one thread a process
IN_REPO = {"cwd": REPO, "env": {**os.environ, "OMP_NUM_THREADS": "1"}, "text": True}


def two_processes(backend: str, args: list[str], script="train_eagle3.py") -> subprocess.CompletedProcess:
    proc = subprocess.run(launch_command(backend, args, script), capture_output=True, timeout=900, **IN_REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def logged(out: Path, key="loss") -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if r["split"] == "train"]


def last_state(out: Path) -> dict:
    return newest_checkpoint(out)[1]


def assert_same_head(out: Path, reference: Path):
    a, b = load_file(out / "final" / "model.safetensors"), load_file(reference / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)


def assert_same_logits(out: Path, reference: Path, model):
    """The EAGLE-3 heads, loaded as a user would, draft the same logits."""
    heads = [load_draft_head(d / "final", model) for d in (out, reference)]
    torch.manual_seed(0)
    aux = torch.randn(1, 12, 3 * model.config.hidden_size)
    ids, pos = torch.randint(0, 1000, (1, 12)), torch.arange(12)[None]
    with torch.no_grad():
        logits = [h.logits(h.ttt_step(h.fc(aux), ids, pos, [])) for h in heads]
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module", autouse=True)
def zero3_partitions_every_parameter(tmp_path_factory):
    """The shipped ZeRO-3 JSON with no parameter kept whole (persistence threshold 0), as in a large head."""
    ds = json.loads((REPO / "configs" / "deepspeed" / "zero3.json").read_text())
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    path = tmp_path_factory.mktemp("deepspeed") / "zero3.json"
    path.write_text(json.dumps(ds))
    LAUNCH["zero3"] = [*LAUNCH["zero3"], "--deepspeed_config_file", str(path)]


@pytest.fixture(scope="module")
def reference(train_store, tmp_path_factory) -> Path:
    """The straight EAGLE-3 run of one process."""
    out = tmp_path_factory.mktemp("reference") / "run"
    result = one_process(train_store, out)
    assert len(result["history"]) == 6
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_trains_the_run_of_one_process(backend, reference, train_store, tmp_path, smollm2):
    """2 processes under each shipped accelerate config: a real world of 2, the loss falls, and the
    head the run saves (gathered from FSDP / ZeRO-3 shards) is the one-process head."""
    out = tmp_path / backend
    two_processes(backend, overrides(train_store, out))
    assert last_state(out)["num_processes"] == 2
    losses = logged(out)
    assert losses == pytest.approx(logged(reference), rel=1e-4)
    assert logged(out, "grad_norm") == pytest.approx(logged(reference, "grad_norm"), rel=1e-4)
    assert sum(losses[-2:]) < 0.8 * sum(losses[:2])
    assert_same_head(out, reference)
    assert_same_logits(out, reference, smollm2[0])


RESUMES = [  # (first leg, second leg): "one" is 1 process x 2 micro-batches, the others 2 x 1
    pytest.param("ddp", "one", marks=pytest.mark.slow),
    ("one", "ddp"),
    pytest.param("fsdp", "fsdp", marks=two_gpus),
    pytest.param("zero2", "zero2", marks=[deepspeed, pytest.mark.slow]),
    pytest.param("zero3", "zero3", marks=[deepspeed, pytest.mark.slow]),
]


@pytest.mark.parametrize("first, second", RESUMES)
def test_a_run_stopped_and_resumed_across_backends_and_counts_is_the_straight_run(
    first, second, reference, train_store, tmp_path
):
    """Stopped mid-epoch after step 2, then resumed (resume=auto): the same data order (samples
    consumed), the straight run's loss curve and its head."""
    out = tmp_path / "run"
    for leg, extra in ((first, ["stop_after_step=2"]), (second, ["resume=auto"])):
        if leg == "one":
            one_process(train_store, out, *extra)
        else:
            two_processes(leg, overrides(train_store, out, *extra))
    assert logged(out) == pytest.approx(logged(reference), rel=1e-4)
    state, straight = last_state(out), last_state(reference)
    assert state["step"] == straight["step"] and state["samples_consumed"] == straight["samples_consumed"]
    assert state["num_processes"] == (1 if second == "one" else 2)
    assert_same_head(out, reference)


@deepspeed
@pytest.mark.slow
def test_a_zero_checkpoint_resumes_only_under_zero_with_its_process_count(train_store, tmp_path):
    """ZeRO saves one optimizer partition per process: a resume under DDP, or under ZeRO with 1
    process, is refused, naming the launch that resumes it."""
    out = tmp_path / "run"
    two_processes("zero2", overrides(train_store, out, "stop_after_step=2"))
    checkpoint = out / "checkpoint-2"
    assert sorted(p.name for p in checkpoint.glob("optimizer*")) == ["optimizer-rank0.pt", "optimizer-rank1.pt"]
    for layout, processes, error in [
        ("whole", 2, "saved by DeepSpeed ZeRO-2 and this launch is one process or DDP: resume it with deepspeed_zero2"),
        ("zero2", 1, "sharded over 2 processes (2 optimizer-rank files; FSDP or DeepSpeed ZeRO) and this run has 1"),
    ]:
        with pytest.raises(ValueError, match=re.escape(error)):
            check_resumable(checkpoint, processes, layout)
    check_resumable(checkpoint, 2, "zero2")


REFUSED = [  # (what `accelerate launch` tells the process, extra overrides, what the error says)
    pytest.param(
        "ACCELERATE_USE_FSDP",
        [],
        "asks for FSDP, which accelerate runs on GPUs only: without one it would silently train plain DDP",
        marks=pytest.mark.skipif(torch.cuda.is_available(), reason="refused only on a machine without a GPU"),
        id="fsdp-without-gpu",
    ),
    pytest.param(
        "ACCELERATE_USE_DEEPSPEED",
        ["method=peagle", "num_segments=2"],
        "DeepSpeed steps its optimizer inside every backward: set num_segments=1, or train with DDP or FSDP",
        id="zero-peagle-segments",
    ),
    pytest.param(
        "ACCELERATE_USE_DEEPSPEED",
        ["gradient_accumulation_steps=2"],
        "DeepSpeed steps its optimizer inside every backward: use gradient_accumulation_steps=1",
        id="zero-accumulation",
    ),
]


@pytest.mark.parametrize("launched, extra, error", REFUSED)
def test_what_a_backend_cannot_run_is_refused_before_any_compute(
    launched, extra, error, train_store, tmp_path, monkeypatch
):
    """The process of such a launch (its environment says the backend) refuses before the target loads."""
    monkeypatch.setenv(launched, "true")
    monkeypatch.setattr("eagle_train.trainer.load_target", lambda *a, **k: pytest.fail("the target loaded"))
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=re.escape(error)):
        run(load_train_config(None, overrides(train_store, out, *extra)))
    assert not out.exists()


def test_two_nodes_on_one_machine_train_one_head(reference, train_store, tmp_path):
    """Two `accelerate launch` commands, one per node (--num_machines 2 --machine_rank 0|1), train
    the one-process run together."""
    out = tmp_path / "nodes"
    port = free_port()
    nodes = [
        subprocess.Popen(
            launch_command("ddp", overrides(train_store, out), machines=(rank, port)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            **IN_REPO,
        )
        for rank in (0, 1)
    ]
    for node in nodes:
        output, _ = node.communicate(timeout=900)
        assert node.returncode == 0, output[-4000:]
    assert last_state(out)["num_processes"] == 2
    assert logged(out) == pytest.approx(logged(reference), rel=1e-4)
    assert_same_head(out, reference)


@pytest.mark.parametrize(
    "backend, segments",
    [
        ("ddp", 2),
        pytest.param("zero2", 1, marks=[deepspeed, pytest.mark.slow]),
        pytest.param("zero3", 1, marks=[deepspeed, pytest.mark.slow]),
    ],
)
def test_peagle_on_two_processes_has_the_gradients_of_one_process(backend, segments, train_store, tmp_path):
    """P-EAGLE on 2 processes: every step's gradient norm, loss and the final head equal one
    process's over the same samples (the depth draws are seeded per micro-batch, not per process).
    Under DDP with 2 sequence segments: a backward each, the first inside no_sync."""
    peagle = ["method=peagle", "num_depths=3", f"num_segments={segments}"]
    one = one_process(train_store, tmp_path / "one", *peagle)
    out = tmp_path / backend
    two_processes(backend, overrides(train_store, out, *peagle), script="train_peagle.py")
    assert last_state(out)["num_processes"] == 2
    assert logged(out, "grad_norm") == pytest.approx([m["grad_norm"] for m in one["history"]], rel=1e-4)
    assert logged(out) == pytest.approx([m["loss"] for m in one["history"]], rel=1e-4)
    assert_same_head(out, tmp_path / "one")


def test_a_run_that_diverges_stops_on_every_process_in_one_line(train_store, tmp_path):
    """A learning rate that sends the head to inf: the loss of step 2 is nan on the pooled metrics, so both
    processes stop there alike (no hang), say so in one line, and save no head."""
    out = tmp_path / "run"
    proc = subprocess.run(
        launch_command("ddp", overrides(train_store, out, "learning_rate=1e30")),
        capture_output=True,
        timeout=300,
        **IN_REPO,
    )
    assert proc.returncode != 0
    # the processes share stderr: a line may follow the other's progress bar, and the launcher ends one
    # process when the other exits, so one of the two lines may be missing
    errors = set(re.findall(r"error: .*", proc.stderr))
    assert len(errors) == 1, proc.stderr[-3000:]
    assert re.fullmatch(
        r"error: step 2: loss is nan .*learning_rate is too high; no checkpoint was saved", errors.pop()
    )
    assert not list(out.glob("checkpoint-*")) and not (out / "final").exists()
