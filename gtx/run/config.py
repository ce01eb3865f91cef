"""What a run is: its configuration, resolved and checked before anything is written."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass

import torch

from gtx.attention.module import check_budget, check_pattern, check_trainable
from gtx.backends import Backend, get_backend
from gtx.data.batch import make_batch
from gtx.data.task import Task
from gtx.errors import GtxError
from gtx.graph.pattern import Pattern
from gtx.graph.spec import build_pattern, parse_pattern
from gtx.model.layers import model_forms
from gtx.plugins.registry import LOGGERS, MODELS, TASKS
from gtx.records.results import identity_keys, stored_settings
from gtx.records.run_config import RunConfig
from gtx.run.train import PhaseStats, TrainConfig, check_precision
from gtx.values import out_of_range, parse_scalar

MAX_SEED = 2**31 - 1  # seeds derived from it (per epoch, per rank) stay within torch's and numpy's 64-bit range
NEARLY_COMPLETE = 0.99  # density from which a pattern counts as full attention (complete_note)


@dataclass
class Resolved:
    """Everything a run needs, checked before anything is written."""

    config: RunConfig
    task: Task
    model_cls: type
    model_config: object
    task_config: object
    train: TrainConfig
    pattern_run: Pattern  # what the graphs use: ``pattern_given``, wrapped by the model's modifier (ut: act)
    pattern_given: Pattern  # the pattern as given (--pattern, a grid), canonical: the results' ``pattern`` column
    device: torch.device
    backend: Backend  # ``config.backend`` found and checked usable on ``device``, once
    density: dict[str, float]  # per stage, on the first training batch: 1.0 is full attention
    cell: str  # Configs.keys(): the results' ``cell`` column
    experiment: str  # ... and its ``experiment`` column (the cell without the seed)

    def as_dict(self) -> dict:
        return {
            **dataclasses.asdict(self.config),
            "pattern": self.pattern_run.spec,
            "device": str(self.device),
            "model_config": dataclasses.asdict(self.model_config),
            "task_config": dataclasses.asdict(self.task_config),
            "train": stored_settings("train", dataclasses.asdict(self.train)),
        }

    @property
    def definitions(self) -> dict[str, int]:
        """The definition version of each method the run's attention runs that declares one (its pattern's
        parts, and those generated tokens read by): the results' ``definitions`` column."""
        return dict(sorted({**self.pattern_run.definitions, **self.decode.definitions}.items()))

    @property
    def decode(self) -> Pattern:
        """The pattern generated tokens read their keys by (``train.decode_pattern``; empty: the run's)."""
        return parse_pattern(self.train.decode_pattern) if self.train.decode_pattern else self.pattern_run


def parse_value(kind: str, name: str, key: str, raw: str, typ) -> object:
    """Convert a ``--set`` string to a config field's type; errors name the key and the type."""
    base = typing.get_origin(typ) or typ
    if base in (bool, int, float, str):
        try:
            return parse_scalar(raw, base)
        except ValueError:
            raise GtxError(f"--set {key}={raw}: {kind} {name!r} expects {base.__name__} for {key}") from None
    raise GtxError(f"--set {key}: {kind} {name!r} field has unsupported type {typ}")


def build_configs(settings: dict[str, str], targets: dict[str, tuple[str, type]]) -> dict[str, object]:
    """Split ``settings`` among dataclasses: ``targets`` maps model/task/train -> (name, config class)."""
    fields = {k: {f.name: f for f in dataclasses.fields(cls)} for k, (_, cls) in targets.items()}
    hints = {k: typing.get_type_hints(cls) for k, (_, cls) in targets.items()}
    values: dict[str, dict] = {k: {} for k in targets}
    for key, raw in settings.items():
        scope, _, short = key.rpartition(".")
        owners = [scope] if scope else [k for k in targets if short in fields[k]]
        if scope and scope not in targets:
            raise GtxError(f"--set {key}: unknown prefix {scope!r}; use model., task. or train.")
        if not owners or short not in fields[owners[0]]:
            listing = "; ".join(f"{k} {targets[k][0]}: {', '.join(fields[k])}" for k in (owners or targets))
            raise GtxError(f"--set {key}: no such setting; known settings: {listing}")
        if len(owners) > 1:
            raise GtxError(f"--set {key}: both {' and '.join(owners)} have {short!r}; write {owners[0]}.{short}=...")
        kind, name = owners[0], targets[owners[0]][0]
        values[kind][short] = parse_value(kind, name, key, raw, hints[kind][short])
    out = {}
    for kind, (name, cls) in targets.items():
        try:
            out[kind] = cls(**values[kind])
        except (TypeError, ValueError) as e:
            raise GtxError(f"bad settings for {kind} {name!r}: {e}") from None
        bad = out_of_range(out[kind])
        if bad:
            field_name, value, interval = bad
            owner = "training" if kind == "train" else f"{kind} {name!r}"
            raise GtxError(f"--set {field_name}={value}: {owner} needs {field_name} in {interval}")
    return out


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise GtxError("--device cuda: no CUDA GPU is visible to torch here; use --device cpu (or auto)")
    if name not in ("cpu", "cuda"):
        raise GtxError(f"--device {name}: choose cpu, cuda or auto")
    return torch.device(name)


@dataclass
class Configs:
    """A run's configs and patterns, resolved without touching data: cheap enough for every cell of a sweep."""

    config: RunConfig
    task_entry: object
    model_entry: object
    model: object
    task: object
    train: TrainConfig
    pattern_given: Pattern
    pattern_run: Pattern

    def keys(self) -> tuple[str, str]:
        """``results.identity_keys``: the run's cell (task, model, given pattern, backend, seed and
        every resolved setting: ``--epochs 4`` and ``--set train.epochs=4`` give one key; not the
        device or folder) and its experiment (the same without the seed)."""
        c = self.config
        configs = {
            "model_config": dataclasses.asdict(self.model),
            "task_config": dataclasses.asdict(self.task),
            "train": dataclasses.asdict(self.train),
        }
        return identity_keys(c.task, c.model, self.pattern_given.spec, c.backend, configs, c.seed)


def resolve_configs(config: RunConfig) -> Configs:
    """Names, settings and the pattern spec checked and resolved; no data generated, nothing written."""
    if not 0 <= config.seed <= MAX_SEED:
        raise GtxError(f"--seed {config.seed}: choose a seed from 0 to {MAX_SEED}")
    task_entry, model_entry = TASKS.get(config.task), MODELS.get(config.model)
    for name in config.loggers:
        LOGGERS.get(name)
    defaults = {f"train.{k}": str(v) for k, v in getattr(task_entry.obj, "train_defaults", {}).items()}
    given = {key.rpartition(".")[2] for key in config.settings}
    cfg = build_configs(
        {**{k: v for k, v in defaults.items() if k.rpartition(".")[2] not in given}, **config.settings},
        {
            "model": (config.model, model_entry.config),
            "task": (config.task, task_entry.config),
            "train": ("train", TrainConfig),
        },
    )
    config = dataclasses.replace(config, settings=_as_resolved(config.settings, cfg))
    pattern_given = parse_pattern(config.pattern)
    if cfg["train"].decode_pattern:  # canonical, and empty where it is the run's own: one experiment either way
        decode = parse_pattern(cfg["train"].decode_pattern).spec
        cfg["train"].decode_pattern = "" if decode == pattern_given.spec else decode
    model_cls = model_entry.obj
    wrap = _modifier(model_cls, cfg["model"])
    if pattern_given.dynamic and not wrap:
        raise GtxError(
            f"pattern {pattern_given.spec!r} filters its edges by the nodes still computing (ACT), which model {config.model!r} does "
            f"not have: it would do nothing; use a model with ACT ({', '.join(_act_models())}), or drop the act(...)"
        )
    # a pattern already filtered at run time (act(P) given to a model that adds act itself) is not wrapped twice
    pattern_run = build_pattern(wrap, {}, pattern_given) if wrap and not pattern_given.dynamic else pattern_given
    return Configs(config, task_entry, model_entry, cfg["model"], cfg["task"], cfg["train"], pattern_given, pattern_run)


def _as_resolved(settings: dict[str, str], configs: dict[str, object]) -> dict[str, str]:
    """``settings`` with each text setting as its config resolved it (hf's ``path``: absolute), so
    that a run stored with them rebuilds the same from any working folder."""
    out = {}
    for key, raw in settings.items():
        scope, _, short = key.rpartition(".")
        owner = configs[scope] if scope else next(c for c in configs.values() if short in _fields(c))
        value = getattr(owner, short)
        out[key] = value if isinstance(value, str) else raw
    return out


def _fields(config) -> set[str]:
    return {f.name for f in dataclasses.fields(config)}


def _modifier(model_cls, model_config) -> str | None:
    """The modifier pattern (``act``) a model of this class and config wraps around the run's pattern."""
    if hasattr(model_cls, "modifier"):
        return model_cls.modifier(model_config)
    return getattr(model_cls, "dynamic_pattern", None)


def _act_models() -> list[str]:
    """The registered models that wrap a run-time modifier (ACT) around the pattern: with their
    defaults (``ut``), or with a ``universal`` setting on (``lm --set universal=true``)."""
    out = []
    for name, entry in sorted(MODELS.entries().items()):
        fields = {f.name for f in dataclasses.fields(entry.config)} if dataclasses.is_dataclass(entry.config) else set()
        try:
            if _modifier(entry.obj, entry.config()):
                out.append(name)
            elif "universal" in fields and _modifier(entry.obj, entry.config(universal=True)):
                out.append(f"{name} --set universal=true")
        except (TypeError, ValueError):  # a plugin's config that cannot be made bare: not listed
            continue
    return out


def cell_key(config: RunConfig) -> str:
    """The cell of a run configuration (``Configs.keys``): what a sweep looks for in the results' ``cell`` column."""
    return resolve_configs(config).keys()[0]


def check_positions(config: RunConfig, model_config, max_len: int | None, length: int | None) -> None:
    """One line when the task's sequences (``length`` tokens) are longer than the model has positions for."""
    if max_len is None or length is None or length <= max_len:
        return
    if getattr(model_config, "path", ""):
        fix = f"they are the pretrained model's (path={model_config.path}): shorten the task's sequences"
    elif hasattr(model_config, "max_len"):
        fix = f"raise --set max_len={length} or shorten the task's sequences"
    else:
        fix = "shorten the task's sequences"
    raise GtxError(
        f"task {config.task!r} has sequences of {length} tokens but model {config.model!r} has positions for {max_len}; {fix}"
    )


def check_batch_size(config: RunConfig, train: TrainConfig, examples: int) -> None:
    """One line when a batch size the user gave is larger than the training split: a number that
    cannot be meant (the task's own default may be, for a small split: one batch an epoch)."""
    given = any(key.rpartition(".")[2] == "batch_size" for key in config.settings)
    if given and train.epochs and train.batch_size > examples:
        raise GtxError(
            f"--batch-size {train.batch_size}: task {config.task!r} has {examples:,} training examples, fewer than one "
            f"batch; give at most {examples:,} (one batch an epoch), or more examples"
        )


def check_beam(beam: int, task: Task, given: str) -> None:
    """One line when a beam (``given``: the option that set it, with its value) is wider than the target vocabulary: its
    hypotheses per sample times the batch are held at once (a beam of 100,000 ran out of memory),
    and a wider beam than the tokens a step chooses from is not what anyone means."""
    if task.form == "seq2seq" and beam > len(task.tgt_vocab):
        raise GtxError(
            f"{given}: task {task.name!r} decodes from {len(task.tgt_vocab)} target tokens; "
            f"give a beam of at most {len(task.tgt_vocab)}"
        )


def resolve(config: RunConfig) -> Resolved:
    """Check everything a run needs, in the order a user fixes it; writes nothing."""
    c = resolve_configs(config)
    config = c.config  # its text settings as resolved
    device = resolve_device(config.device)
    check_precision(c.train.precision)
    backend = get_backend(config.backend, device)
    check_pattern(c.pattern_run, backend, getattr(c.model, "heads", None))
    task = c.task_entry.obj(config.task, c.task)
    tokenizer = getattr(c.model_entry.obj, "tokenizer", None)
    task.tokenizer = tokenizer(c.model) if tokenizer else None
    if task.form not in model_forms(c.model_entry.obj):
        fit = sorted(name for name, e in MODELS.entries().items() if task.form in model_forms(e.obj))
        raise GtxError(
            f"model {config.model!r} does not serve {task.form} tasks such as {config.task!r}; models that do: {', '.join(fit) or '(none)'}"
        )
    max_len = getattr(c.model, "max_len", None) or getattr(c.model_entry.obj, "positions", None)
    task.check_tokenizer()
    _check_decode(config, c, task, get_backend(config.backend, device))
    # before the data: a length past the model's is made for nothing
    check_positions(config, c.model, max_len, task.declared_len())
    task.splits()  # generates or loads the data: a missing data_dir fails here
    check_batch_size(config, c.train, len(task.splits()["train"]))
    check_beam(getattr(c.task, "beam", 1), task, f"--set beam={getattr(c.task, 'beam', 1)}")
    check_positions(config, c.model, max_len, task.context_len())
    probe = PhaseStats()
    # builds and checks the pattern's edges: a leak fails here
    probe.graph_only(make_batch(task, "train", [0], c.pattern_given))
    density = {stage: probe.density(stage) for stage in probe.edges}
    check_budget(c.pattern_given, list(probe.edges), task.context_len())
    heads, dim = getattr(c.model, "heads", None), getattr(c.model, "dim", None)
    check_trainable(c.pattern_given, list(probe.edges), heads, dim, config.model, task.context_len())
    if c.train.decode_pattern:
        check_budget(parse_pattern(c.train.decode_pattern), ["dd"], task.context_len())
    return Resolved(
        config,
        task,
        c.model_entry.obj,
        c.model,
        c.task,
        c.train,
        c.pattern_run,
        c.pattern_given,
        device,
        backend,
        density,
        *c.keys(),
    )


def _check_decode(config: RunConfig, c: Configs, task: Task, backend) -> None:
    """One line for a decode pattern that would change nothing (a task not scored by generation, a
    model that does not generate) or that the model cannot attend with (another pattern's parameters)."""
    if not c.train.decode_pattern:
        return
    decode = parse_pattern(c.train.decode_pattern)
    if not task.new_tokens() or not hasattr(c.model_entry.obj, "generate"):
        why = (
            f"task {config.task!r} is not scored by generation"
            if not task.new_tokens()
            else f"model {config.model!r} does not generate"
        )
        raise GtxError(
            f"--decode-pattern {decode.spec}: {why}, so no token is decoded under it; drop it, or run a task scored "
            "by generation (niah, vt, cwe) with a model that generates (hf)"
        )
    if decode.trainable is not None:
        raise GtxError(
            f"--decode-pattern {decode.spec} attends with parameters of its own, which the run's pattern "
            f"{c.pattern_given.spec!r} does not give the model; decode under a pattern without them, or run with --pattern {decode.spec}"
        )
    check_pattern(decode, backend, getattr(c.model, "heads", None))


def complete_note(
    resolved: Resolved, read: dict[str, float] | None = None, when: str = "", stage: str | None = None
) -> str | None:
    """A warning when a pattern other than full or causal is (nearly) full attention at the task's
    lengths: its results would be full attention's under another name. A fixed pattern is judged
    before the run by its edges (what it attends to); a pattern that chooses or learns its keys at
    run time, or splits heads, by the density a phase recorded (``read``: stage -> density; None: not
    yet; ``when``: which phase). ``stage``: the stage a trainable method ran in (``Trainable.describe``):
    a method that reads every key in a stage (DSA's dense stage) is said to, not called full attention."""
    if resolved.pattern_given.spec.split("+")[0] in ("full", "causal"):
        return None
    fixed = (
        resolved.pattern_given.select is None
        and not resolved.pattern_given.heads
        and resolved.pattern_given.trainable is None
    )
    density = resolved.density if fixed else read
    if not density or min(density.values()) < NEARLY_COMPLETE:
        return None
    stages = ", ".join(f"{s} {d:.3f}" for s, d in density.items())
    if fixed:
        return (
            f"note: pattern {resolved.pattern_given.spec} is (nearly) full attention at task {resolved.config.task!r}'s lengths (density {stages}); "
            "it measures full attention here: use longer sequences or a sparser setting"
        )
    if stage:
        return f"note: pattern {resolved.pattern_given.spec} read every key its queries could see {when} (density {stages}): it ran in its {stage}"
    return (
        f"note: pattern {resolved.pattern_given.spec} read (nearly) every key its queries could see {when} (density {stages}): it is full attention "
        f"at task {resolved.config.task!r}'s lengths; use longer sequences or a sparser setting"
    )
