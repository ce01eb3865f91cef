"""A frontier's axes, as a user writes them: families (a pattern and its budgets, ``parse_family``)
and a ``Study`` (families, lengths, and a sweep grid for the rest), checked before anything runs."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from gtx.errors import GtxError
from gtx.graph.spec import parse_pattern
from gtx.sweeps.grid import Grid, split_list

FULL = "full"  # every frontier's baseline
KEY_RE = re.compile(r"\s*([A-Za-z_]\w*)\s*=\s*(.*)\Z", re.S)
OPERATORS = "+|&"  # pattern-spec operators (gtx.graph.spec): what follows one applies to every budget
#: where a family's patterns apply, for tasks scored by generation: everywhere (--family), the prompt
#: alone with generated tokens under full (--prefill-family), or generated tokens alone after a prompt
#: read under full (--decode-family); what sets them: the run's pattern and its decode_pattern setting
ALL, PREFILL, DECODE = "all", "prefill", "decode"
PHASES = (ALL, PREFILL, DECODE)
OPTIONS = {ALL: "--family", PREFILL: "--prefill-family", DECODE: "--decode-family"}
DECODE_SETTING = "decode_pattern"


@dataclass(frozen=True)
class Family:
    """A pattern and its budgets: ``specs[i]`` is the pattern with ``param`` = ``budgets[i]``
    (``param`` None: one budget, the spec as given). ``name``: the pattern's name with the fixed
    parameters given (``moba b=8 gate=block``), so two families of one pattern stay apart."""

    name: str
    param: str | None
    budgets: tuple[str, ...]
    specs: tuple[str, ...]
    phase: str = ALL  # where the specs apply: ALL (prompt and generated tokens), PREFILL or DECODE (PHASES)


def _split_operator(text: str) -> tuple[str, str]:
    """``local:w=8,16+alibi`` -> (``local:w=8,16``, ``+alibi``): the family's first pattern and the
    rest of the spec from its first ``+``, ``|`` or ``&`` outside parentheses (``""`` where none)."""
    depth = 0
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if depth == 0 and ch in OPERATORS:
            return text[:i], text[i:]
    return text, ""


def parse_family(text: str, phase: str = ALL) -> Family:
    """``local:w=16,32,64`` or ``moba:b=16,k=2,4,8`` (the one parameter given several values is the
    budget) or a single spec (``nsa``). What follows the first pattern after ``+``, ``|`` or ``&``
    (``local:w=8,16+alibi``, ``local:w=8,16|strided:l=8``) applies to every budget; a budget list
    there is refused. ``phase`` (``PHASES``): where the patterns apply; a family of one phase but
    ``ALL`` is named so (``sinks s=4 (decode)``). Raises GtxError naming the family and the fix."""
    head, rest = _split_operator(text.strip())
    name, _, params = head.strip().partition(":")
    values: dict[str, list[str]] = {}
    last = None
    try:
        items = split_list(params) if params else []
    except GtxError:
        raise GtxError(f"family {text!r}: an empty item between commas; write name:param=v1,v2,v3") from None
    for item in items:
        m = KEY_RE.match(item)
        if m:
            last = m[1]
            if last in values:
                raise GtxError(
                    f"family {text!r}: parameter {last!r} is given twice; list its budgets once, {last}=a,b,c"
                )
            values[last] = [m[2].strip()]
        elif last is None:
            raise GtxError(f"family {text!r}: {item!r} follows no parameter; write name:param=v1,v2,v3")
        else:
            values[last].append(item)
    swept = [k for k, v in values.items() if len(v) > 1]
    if len(swept) > 1:
        raise GtxError(
            f"family {text!r}: {', '.join(swept)} all have several values; a family sweeps one budget parameter (write one family per combination)"
        )
    param = swept[0] if swept else None
    budgets = values[param] if param else [",".join(f"{k}={v[0]}" for k, v in values.items()) or "-"]
    specs = []
    for budget in budgets if param else [None]:
        spec = (
            f"{name}:{','.join(f'{k}={budget if k == param else v[0]}' for k, v in values.items())}" if values else name
        )
        try:
            pattern = parse_pattern(spec + rest)
        except GtxError as e:
            # a bare value after a comma: a budget list in the rest
            if rest and re.search(r",\s*[^\s=,()|&+]+\s*(?:[|&+)]|\Z)", rest):
                raise GtxError(
                    f"family {text!r}: only the first pattern's parameter may list budgets; write the pattern whose budgets vary "
                    "first, the rest after it (local:w=8,16|strided:l=8: the union with strided at each window)"
                ) from None
            raise GtxError(f"family {text!r}: {e}") from None
        if pattern.spec == FULL:
            raise GtxError(
                f"family {text!r}: full attention is every frontier's baseline already; give sparse patterns"
            )
        specs.append(pattern.spec)
    if len(set(specs)) < len(specs):
        raise GtxError(f"family {text!r}: two budgets give the same pattern; list each budget once")
    fixed = " ".join(f"{k}={v[0]}" for k, v in values.items() if k != param) if param else ""
    if phase not in PHASES:
        raise ValueError(f"phase {phase!r}: choose one of {', '.join(PHASES)}")
    where = "" if phase == ALL else f"({phase})"
    return Family(
        " ".join(f"{name} {fixed} {rest.strip()} {where}".split()), param, tuple(budgets), tuple(specs), phase
    )


def length_key(task: str) -> str:
    """The task setting that sets its sequence length: ``seq_len``, else ``context`` (``--length-key`` names another)."""
    from gtx.plugins.registry import TASKS

    names = {f.name for f in dataclasses.fields(TASKS.get(task).config)}
    for key in ("seq_len", "context"):
        if key in names:
            return key
    raise GtxError(
        f"task {task!r} has no seq_len or context setting; name the setting that sets its length with --length-key "
        f"(its settings: {', '.join(sorted(names))})"
    )


@dataclass
class Study:
    """A frontier's axes: the families, the lengths (values of the task's ``length_key`` setting,
    None: found per task) and a sweep grid for the rest (tasks, models, seeds, sizes as settings)."""

    families: list[Family]
    lengths: list[str]
    grid: Grid
    length_key: str | None = None
    notes: list[str] = field(default_factory=list)

    def __post_init__(self):
        if self.length_key is not None and not self.length_key.strip():
            raise GtxError(
                "--length-key '': name the task setting that sets the length (seq_len, context, ...), or leave "
                "--length-key out for the task's own"
            )
        named: dict[str, Family] = {}
        owner: dict[tuple[str, str], Family] = {}
        for f in self.families:  # the table groups by family name and budget spec: neither may be in two families
            option = OPTIONS[f.phase]
            if f.name in named:
                raise GtxError(
                    f"{option} {f.name!r} is given twice ({_budgets(named[f.name])} and {_budgets(f)}); give each "
                    f"pattern's budgets once, in one {option}"
                )
            named[f.name] = f
            for spec in f.specs:
                if (f.phase, spec) in owner:
                    raise GtxError(
                        f"pattern {spec!r} is a budget of two families ({owner[f.phase, spec].name!r} and {f.name!r}); give it in one"
                    )
                owner[f.phase, spec] = f
        given = [k for k in self.grid.settings if k.rpartition(".")[2] == DECODE_SETTING]
        phased = [f for f in self.families if f.phase != ALL]
        if given and (phased or len(self.grid.settings[given[0]]) > 1):
            raise GtxError(
                f"--set {given[0]}=...: a frontier sets each cell's decode pattern from its families; give the patterns "
                "generated tokens read under as --decode-family (the prompt under full) and drop the --set"
            )

    def key(self, task: str) -> str:
        return self.length_key or length_key(task)


def _budgets(f: Family) -> str:
    return f"{f.param}={','.join(f.budgets)}" if f.param else f.specs[0]
