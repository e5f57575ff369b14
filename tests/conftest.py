import fcntl
import json
import os
from collections import Counter
from contextlib import contextmanager, nullcontext
from pathlib import Path
from types import SimpleNamespace

import pytest

WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if WORKER:
    # The workers share the machine's cores: each gets its share of compute threads, and the processes
    # its tests start inherit it. Two workers of two OpenMP threads on two cores spin-wait on each
    # other: in-process training took twice the CPU time (tests/test_stages.py: 28 s against 13 s).
    share = (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, share)))

import torch  # noqa: E402  (after OMP_NUM_THREADS, which torch reads when it is imported)

# Without a GPU, Triton kernels run in Triton's interpreter, so the kernel tests check the kernels
# themselves on any machine. Read when a kernel is defined, so it is set before any is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# ---- three test processes at once (pytest-xdist, `-n 3` in pyproject's addopts) -------------------
# The suite is mostly one core's work: imports, Lightning's loop around tiny models, waits for child
# processes. Three workers run the test files side by side on 2 cores: with two, the cores idled
# while tests waited on timeouts, heartbeats and servers (the suite took 630 s, against 517 to 557 s
# with three). What is computed once per run (the dataset cache, the session's shared runs) is shared
# between them through the folder they all work in, under a file lock; a test marked `alone` (it
# times something, or waits on a heartbeat) runs while the other workers wait between tests.


def run_folder(tmp_path_factory) -> Path:
    """The folder every test process of this run shares (each xdist worker's own tmp folder is in it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if WORKER else base


@contextmanager
def locked(path: Path, operation: int = fcntl.LOCK_EX):
    """Hold ``flock(operation)`` on the file ``path`` (created if missing) for the block."""
    with open(path, "a") as handle:
        fcntl.flock(handle, operation)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def expected_seconds(item) -> float:
    """What a test is expected to take in the suite: ``slow(seconds=N)`` where measured (a test of 20 s
    or more: its setup, shared runs it starts, and the wait for the cores), else 8 for a slow test
    and a tenth of a second for the others (their median). Only the order of the files depends on it."""
    slow = item.get_closest_marker("slow")
    return slow.kwargs.get("seconds", 8) if slow else 0.1


def pytest_collection_modifyitems(items):
    """The files expected to take longest first, and the files with an `alone` test last. xdist hands
    the workers whole files in collection order (`--no-loadscope-reorder`: by default it puts the
    files with the most tests first), so the long files start early and the last ones are short:
    ordered by their count of slow tests, the pipeline file (one test, two minutes) started last
    but one and its worker ran on alone. An `alone` test waits for the other workers' current tests
    to end: among the long files it waited up to a minute for one, with both cores idle."""
    expected = Counter()
    for item in items:
        expected[item.path] += expected_seconds(item)
    has_alone = {item.path for item in items if item.get_closest_marker("alone")}
    items.sort(key=lambda item: (item.path in has_alone, -expected[item.path]))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under xdist, every test holds a shared lock from its setup to its teardown (fixtures it starts
    included) and an `alone` test an exclusive one. The gate lets an `alone` test in ahead of the
    other workers' next tests instead of waiting for a gap between them. `crowd` tests take turns
    among themselves: two process groups whose processes wait on each other many times a second,
    on 2 cores, each wait for the other's processes to be scheduled (the four-rank parity runs took
    50 s beside single-process tests, 85 to 104 s beside the SAC learner and its actor)."""
    if not WORKER:
        return (yield)
    folder = Path(item.config.option.basetemp).parent
    alone = item.get_closest_marker("alone") is not None
    crowd = item.get_closest_marker("crowd") is not None
    with (
        locked(folder / "tests-crowd.lock") if crowd else nullcontext(),
        open(folder / "tests-running.lock", "a") as running,
    ):
        with locked(folder / "tests-gate.lock"):
            fcntl.flock(running, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        try:
            return (yield)
        finally:
            fcntl.flock(running, fcntl.LOCK_UN)


@pytest.fixture(scope="session", autouse=True)
def isolated_environment(tmp_path_factory):
    """Generated datasets go to one cache per test session; nothing logs to a real tracking server."""
    cache = run_folder(tmp_path_factory) / "uma_cache"  # a dataset is generated once per run, under a lock
    cache.mkdir(exist_ok=True)
    saved = {key: os.environ.get(key) for key in ("UMA_CACHE_DIR", "MLFLOW_TRACKING_URI")}
    os.environ["UMA_CACHE_DIR"] = str(cache)
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(autouse=True)
def no_tracking_uri_left_behind():
    """``mlflow.set_tracking_uri`` exports $MLFLOW_TRACKING_URI: a test that calls it (a server
    test) must not send the runs of later tests' child processes to its store."""
    yield
    os.environ.pop("MLFLOW_TRACKING_URI", None)


@pytest.fixture(scope="session")
def mlflow_store(tmp_path_factory):
    """One embedded MLflow store for the session's training runs: creating its tables takes seconds."""
    return tmp_path_factory.mktemp("mlruns")


# ---- expensive runs that several tests read: one each per session -------------------------------
# A new test that needs a trained run reads one of these (or adds one here) rather than training
# its own. They must be treated as read-only: a test that changes a run copies it to its tmp_path.

PRETRAIN_STEPS = 30


@pytest.fixture(scope="session")
def pretrained(tmp_path_factory) -> SimpleNamespace:
    """The pretrain recipe run as a user runs it, in a fresh directory and a process of its own, on
    the stage tests' small data: the recipe test reads its log and MLflow run, the pipeline test
    mid-trains from its checkpoint. Run once per test run: the first worker to need it runs it, the
    other waits for it."""
    import forked_cli  # imports the package: only after TRITON_INTERPRET is set, above
    from suite import STAGE_DATA, recipe

    cwd = run_folder(tmp_path_factory) / "pretrained"
    log, status = cwd / "pretrain.log", cwd / "exit-status"
    argv = ["fit", "--config", recipe("pretrain"), *STAGE_DATA, "--data.batch_size", "16",
            "--trainer.max_steps", str(PRETRAIN_STEPS), "--trainer.val_check_interval", str(PRETRAIN_STEPS)]  # fmt: skip
    with locked(cwd.with_name("pretrained.lock")):
        if not status.exists():
            cwd.mkdir(exist_ok=True)
            status.write_text(str(forked_cli.run(argv, log, cwd, timeout=900)))
    return SimpleNamespace(
        code=int(status.read_text()), log=log.read_text(), cwd=cwd, steps=PRETRAIN_STEPS, argv=argv,
        checkpoints=cwd / "runs" / "pretrain" / "checkpoints", store=f"sqlite:///{cwd / 'mlruns' / 'mlflow.db'}",
    )  # fmt: skip


@pytest.fixture(scope="session")
def tiny_vlms(tmp_path_factory) -> dict:
    """A directory per family of ``hf_models.FAMILIES``: a tiny random vision-language model as
    ``save_pretrained`` writes it. Written once per test run, under a lock; read-only."""
    from hf_models import FAMILIES, tiny_vlm_dir

    folder = run_folder(tmp_path_factory) / "vlms"
    folder.mkdir(exist_ok=True)
    with locked(folder.with_name("vlms.lock")):
        return {family: tiny_vlm_dir(family, folder) for family in FAMILIES}


@pytest.fixture
def s3():
    """A local S3-compatible server (moto) with a bucket `robots`: (its s3fs filesystem, fsspec options)."""
    from moto.server import ThreadedMotoServer

    from uma_lightning.ports import free_port

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    options = {
        "key": "test-key",
        "secret": "test-secret",
        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}", "region_name": "eu-west-1"},
    }
    import s3fs

    fs = s3fs.S3FileSystem(**options)
    fs.makedirs("robots", exist_ok=True)  # moto's state is per process: an earlier test's server made it already
    yield fs, options
    server.stop()


# ---- uma parity: one launch per group size, many models and injected faults in each ---------------

FAULT = "parallel_faults.InjectedFault"


def vlm_parity_case(label: str, strategies: str, directory, stage: str, **strategy_args):
    """A ``uma parity`` case of a tiny pretrained VLM (``tiny_vlms``) as the backbone of ``stage``
    (pretrain: the token head; posttrain: the flow expert, 32 wide)."""
    from suite import parity_case, recipe

    vlm = ["--model.network.pretrained", str(directory), "--model.network.max_text_len", "8"]
    expert = ["--model.init_from", "null", "--model.expert", json.dumps({"dim": 32, "ffn_dim": 64}),
              "--data.action_horizon", "4"] if stage == "posttrain" else []  # fmt: skip
    return parity_case(label, strategies, *vlm, *expert, config=recipe(stage), **strategy_args)


@pytest.fixture(scope="session")
def parity_on_two_processes(tiny_vlms):
    """Results (case label -> strategy -> result) of one launch of two processes: the small model
    with every second block checkpointed and the environment-state head; the FiLM keypoint
    tokenizer under tp; post-training's flow model (backbone and action expert) with its EMA; two
    model shapes drawn at random; the pipeline with two interleaved stages per rank; a mixture of
    experts under ep, in 1F1B pipeline stages and under tp; tiny pretrained VLMs as backbones
    (SmolVLM's family with the token head, PaliGemma's with the flow expert and checkpointed
    layers); and one injected bug per case."""
    from suite import PARITY_MOE, PARITY_MOE_TP, PARITY_SIZE, parity_case, recipe

    from uma_lightning.parallel import ParallelConfig, PipelineConfig
    from uma_lightning.tools.parity import check_parity, random_network

    def fault(name, strategies, *overrides):
        return parity_case(name, strategies, *overrides, "--model.init_args.fault", name, module=FAULT)

    vision = {"tokenizer": "keypoints", "film": True, "n_keypoints": 8, "channels": 8}
    expert = [
        "--model.init_from",
        "null",
        "--model.expert",
        json.dumps({"dim": 32, "ffn_dim": 64}),
        "--data.action_horizon",
        "4",
    ]
    cases = [
        parity_case("posttrain", "ddp,fsdp,tp", *expert, config=recipe("posttrain")),
        parity_case(
            "recipe",
            "ddp,fsdp,tp",
            "--model.network.environment_state_weight",
            "0.5",
            wrapping=ParallelConfig(activation_checkpointing="ops", ac_every_n_blocks=2),
        ),
        parity_case(
            "keypoints",
            "tp",
            "--model.network.vision",
            json.dumps(vision),
            "--model.network.environment_state_weight",
            "0.5",
        ),
        *(parity_case(f"shape {seed}", "ddp,fsdp,tp", *random_network(seed)) for seed in (0, 1)),
        # Shapes 0 and 1 cannot be pipelined (an environment-state head; one layer): 2 can. The small
        # model's 1F1B pipeline runs in the experts case (a MoE layer in each stage).
        parity_case("shape 2 in stages", "pp", *random_network(2)),
        fault("unreduced_gradient", "ddp"),
        fault("rank_seed", "ddp,fsdp"),
        fault("wrong_dim", "tp"),
        fault("unreduced_norm", "tp"),
        parity_case(
            "interleaved",
            "pp",
            "--model.network.size",
            json.dumps({**PARITY_SIZE, "n_layers": 4}),
            pipeline=PipelineConfig(schedule="Interleaved1F1B", virtual_stages=2, microbatches=4),
        ),
        fault("unscaled_microbatches", "pp"),
        parity_case("experts", "ep,pp", *PARITY_MOE),
        fault("wrong_rank", "ep", *PARITY_MOE),
        parity_case("experts tp", "tp", *PARITY_MOE_TP),
        fault("unsummed_experts", "tp", *PARITY_MOE_TP),
        vlm_parity_case("vlm idefics3 pretrain", "ddp,fsdp,tp", tiny_vlms["idefics3"], "pretrain"),
        # Its decoder layers recomputed in backward: the expert reads the keys and values they cached.
        vlm_parity_case(
            "vlm paligemma posttrain",
            "ddp,fsdp,tp",
            tiny_vlms["paligemma"],
            "posttrain",
            wrapping=ParallelConfig(activation_checkpointing="full"),
        ),  # fmt: skip
    ]
    return check_parity(cases)


@pytest.fixture(scope="session")
def parity_on_four_processes(tiny_vlms):
    """As ``parity_on_two_processes`` for the 2-D meshes: compiled, checkpointed blocks with FSDP
    keeping gathered blocks until backward and state offloaded to the CPU (aot_eager traces and
    runs the compiled graph like inductor, without generating kernels, which takes minutes on a
    CPU); a model shape drawn at random; a mixture of experts under ep_fsdp (experts over 2 ranks,
    each rank's experts FSDP-sharded over 2), pp_fsdp, fsdp_tp and pp_fsdp_tp; gradients averaged over the wrong group; pipeline
    stages sharded by FSDP (Interleaved1F1B), and tensor-parallel (the zero-bubble V schedule); the
    tiny pretrained VLMs under fsdp_tp, each with the other stage's head than on two processes."""
    from suite import PARITY_MOE, PARITY_MOE_TP, PARITY_SIZE, parity_case

    from uma_lightning.parallel import ParallelConfig, PipelineConfig
    from uma_lightning.tools.parity import check_parity, random_network

    switches = ParallelConfig(
        activation_checkpointing="full",
        compile="blocks",
        compile_backend="aot_eager",
        reshard_after_forward=False,
        cpu_offload=True,
    )
    cases = [
        parity_case("switches", "hsdp,fsdp_tp", wrapping=switches),
        parity_case("shape 2", "hsdp,fsdp_tp,pp_fsdp,pp_fsdp_tp", *random_network(2)),
        parity_case("experts 4", "ep_fsdp,pp_fsdp", *PARITY_MOE),
        parity_case("experts tp 4", "fsdp_tp,pp_fsdp_tp", *PARITY_MOE_TP),
        parity_case("wrong_group", "hsdp", "--model.init_args.fault", "wrong_group", module=FAULT),
        parity_case(
            "pipeline fsdp",
            "pp_fsdp",
            "--model.network.size",
            json.dumps({**PARITY_SIZE, "n_layers": 4}),
            pipeline=PipelineConfig(schedule="Interleaved1F1B", virtual_stages=2, microbatches=4),
        ),
        parity_case(
            "pipeline tp",
            "pp_fsdp_tp",
            "--model.network.size",
            json.dumps({**PARITY_SIZE, "n_layers": 4}),
            pipeline=PipelineConfig(schedule="ZBVZeroBubble", virtual_stages=2, microbatches=2),
        ),
        vlm_parity_case("vlm paligemma pretrain", "fsdp_tp", tiny_vlms["paligemma"], "pretrain"),
        vlm_parity_case("vlm idefics3 posttrain", "fsdp_tp", tiny_vlms["idefics3"], "posttrain"),
    ]
    return check_parity(cases)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` on 127.0.0.1 with its own sqlite store and artifact folder, for one test module."""
    from uma_lightning.tools.mlflow_server import start_mlflow_server

    root = tmp_path_factory.mktemp("mlflow_server")
    process, url = start_mlflow_server(
        f"sqlite:///{root / 'mlflow.db'}", root / "server.log", artifacts=root / "artifacts"
    )
    yield url
    process.terminate()
    process.wait(timeout=30)
