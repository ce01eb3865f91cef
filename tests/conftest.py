import os
import tempfile
import textwrap

import pytest
import torch
from hypothesis import settings

# Property tests draw the same examples on every run: CI's verdict does not depend on the draw (a
# failure found once stays found, the examples being derived from each test's name).
settings.register_profile("gtx", derandomize=True, database=None)
settings.load_profile("gtx")

# Installed third-party plugins must not leak into the tests: load no entry points.
os.environ["GTX_LOAD_PLUGINS"] = ""
os.environ.pop("GTX_PLUGINS_DIR", None)
# Generated task data and the C kernels go to a throw-away cache, not ~/.cache/gtx.
os.environ["GTX_CACHE"] = tempfile.mkdtemp(prefix="gtx-test-cache-")
os.environ.pop("GTX_CACHE_DIR", None)
# Without a GPU the fused selection kernels run under Triton's interpreter (GTX_KERNELS=triton tests):
# Triton reads this when a kernel module is first imported, which gtx does only when one runs.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# No test reads this machine's load: a run or benchmark warns on a busy machine only where a test gives
# it a load to read (gtx.measure.load; tests/test_bench.py checks the real reading, marked slow).
os.environ["GTX_BUSY_CHECK"] = "0"

from gtx.plugins import registry as plugins  # noqa: E402


@pytest.fixture
def plugin_dir(tmp_path):
    """Write plugin files into a temporary folder: ``plugin_dir(name=source, ...)`` returns the folder,
    not yet loaded; whatever gets loaded from it is unregistered afterwards."""
    folder = tmp_path / "user_plugins"
    folder.mkdir()

    def write(**files):
        for name, source in files.items():
            (folder / f"{name}.py").write_text(textwrap.dedent(source))
        return folder

    yield write
    plugins.unload_dir(folder)


@pytest.fixture(scope="module")  # stateless: a module-scoped fixture may use it
def cli():
    """``cli(*args, commands=False)``: ``gtx ARGS`` run in this process, click's Result (kit.invoke)."""
    import kit

    return kit.invoke


@pytest.fixture(scope="module")  # stateless: a module-scoped fixture may use it
def tiny_run():
    """``tiny_run(tmp_path, *args, task=, pattern=, model=, **settings)``: a tiny ``gtx run`` into
    ``tmp_path/results``; ``.result``, ``.folder`` and ``.rows`` (kit.tiny_run)."""
    import kit

    return kit.tiny_run


@pytest.fixture
def tiny_task():
    """A small copy task, generated once per test."""
    from gtx.plugins.registry import TASKS

    entry = TASKS.get("copy")
    task = entry.obj("copy", entry.config(n_train=48, n_valid=12, n_test=12, mean_len=5, std_len=2))
    task.splits()
    return task


@pytest.fixture
def peak_bytes():
    """f -> (f(), the peak of the bytes f held allocated at once), from the profiler's timed allocations."""
    from torch.profiler import ProfilerActivity, profile

    def measure(f):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            result = f()
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        live = peak = 0
        for e in sorted(events, key=lambda e: e.start_ns()):
            live += e.nbytes()
            peak = max(peak, live)
        return result, peak

    return measure


@pytest.fixture
def value_reads():
    """f -> (f(), how many values f read back from tensors: ``item``, ``int``/``bool`` of one, a mask's
    ``nonzero``), each a sync with the device on a GPU. ``.tolist()`` on the CPU reads without an op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Reads(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func._overloadpacket.__name__ in ("_local_scalar_dense", "nonzero", "item")
            return func(*args, **(kwargs or {}))

    def measure(f):
        with Reads() as reads:
            result = f()
        return result, reads.count

    return measure
