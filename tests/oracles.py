"""Independent dense oracles for the built-in patterns: scalar Python, written from the papers'
definitions (Sparse Transformer, Child et al. 2019; Longformer, Beltagy et al. 2020; BigBird,
Zaheer et al. 2020), not from gtx's code. ``allowed(stage, i, j, n_q, n_k)``:
may query i attend to key j?"""


def from_rule(rule, decoder_rule=None):
    """The documented stage mapping: ee = rule, dd = rule (or decoder_rule) and j <= i, ed = rule at
    the aligned source position min(i, n_src - 1)."""

    def allowed(stage, i, j, n_q, n_k):
        if stage == "ee":
            return rule(i, j, n_q)
        if stage == "dd":
            return (decoder_rule or rule)(i, j, n_q) and j <= i
        return rule(min(i, n_k - 1), j, n_k)

    return allowed


def per_stage(ee, dd, ed):
    return lambda stage, i, j, n_q, n_k: {"ee": ee, "dd": dd, "ed": ed}[stage](i, j)


ALWAYS = lambda i, j: True  # noqa: E731
LEFT = lambda i, j: j <= i  # noqa: E731
SELF = lambda i, j: i == j  # noqa: E731


def full():
    return per_stage(ALWAYS, LEFT, ALWAYS)


def causal():
    return per_stage(LEFT, LEFT, ALWAYS)


def bipartite():
    return per_stage(SELF, SELF, ALWAYS)


def local(w):
    return from_rule(lambda i, j, n: abs(i - j) <= w)


def strided(l):
    return from_rule(lambda i, j, n: abs(i - j) <= l or abs(i - j) % l == 0)


def fixed(l, c):
    return from_rule(lambda i, j, n: i // l == j // l or j % l in range(l - c, l))


def longformer(w, g):
    return from_rule(lambda i, j, n: abs(i - j) <= w or i < g or j < g)


def dilated(w, d):
    return from_rule(lambda i, j, n: abs(i - j) <= w * d and (i - j) % d == 0)


def sinks(s, w):
    """StreamingLLM: the first s tokens and the w nearest, the query among them."""
    return from_rule(lambda i, j, n: j < s or abs(i - j) < w)


def bigbird_deterministic(b):
    """BigBird without its random blocks: window of neighbouring blocks plus first/last global blocks."""

    def rule(i, j, n):
        nb = -(-n // b)
        bi, bj = i // b, j // b
        return abs(bi - bj) <= 1 or bi in (0, nb - 1) or bj in (0, nb - 1)

    def decoder_rule(i, j, n):
        return abs(i // b - j // b) <= 1 or i // b == 0 or j // b == 0

    return from_rule(rule, decoder_rule)


def union(a, b):
    return lambda stage, i, j, n_q, n_k: a(stage, i, j, n_q, n_k) or b(stage, i, j, n_q, n_k)
