"""`Einsum` as transposes, sums and batched matrix products."""

from __future__ import annotations

import string

import numpy as np
import onnx

from planner.inputs.decompose._writer import Context, Writer, attr

# --- einsum ------------------------------------------------------------------------------------


def einsum(node: onnx.NodeProto, ctx: Context, w: Writer) -> bool:
    """`Einsum` as transposes, sums and batched matrix products, two operands at a time: for each
    pair, the indices both share and something later needs are a batch, those only they share
    are contracted, and an index no one else needs is summed first. An operand that repeats an
    index (a diagonal or a trace) is left to the table."""
    found = [ctx.shape(name) for name in node.input]
    shapes = [s for s in found if s is not None]
    if len(shapes) != len(found):
        return False
    parsed = _parse_einsum(str(attr(node, "equation", "")), [len(s) for s in shapes])
    if parsed is None:
        return False
    terms, output = parsed
    if any(len(set(t)) != len(t) for t in terms):
        return False
    sizes: dict[str, int] = {}
    for term, extents in zip(terms, shapes):
        for letter, size in zip(term, extents):
            if sizes.get(letter, 1) != size and size != 1 and sizes.get(letter, 1) != 1:
                return False
            sizes[letter] = max(sizes.get(letter, 1), size)
    operands = [(name, term, list(extents)) for name, term, extents in zip(node.input, terms, shapes)]

    def broadcast(name: str, term: str, shape: list[int]) -> tuple[str, list[int]]:
        full = [sizes[c] for c in term]
        if full != shape:
            name = w.op("Expand", [name, w.const(np.array(full, np.int64))])
        return name, full

    def summed(name: str, term: str, shape: list[int], keep: set[str]) -> tuple[str, str, list[int]]:
        drop = [i for i, c in enumerate(term) if c not in keep]
        if not drop:
            return name, term, shape
        name = w.op("ReduceSum", [name, w.const(np.array(drop, np.int64))], keepdims=0)
        return name, "".join(c for c in term if c in keep), [d for i, d in enumerate(shape) if i not in drop]

    def needed(rest: list[tuple[str, str, list[int]]]) -> set[str]:
        return set(output) | {c for _, t, _ in rest for c in t}

    name, term, shape = operands[0]
    name, term, shape = summed(name, term, shape, needed(operands[1:]))
    for i in range(1, len(operands)):
        other, other_term, other_shape = operands[i]
        later = needed(operands[i + 1 :])
        name, term, shape = summed(name, term, shape, later | set(other_term))
        other, other_term, other_shape = summed(other, other_term, other_shape, later | set(term))
        name, shape = broadcast(name, term, shape)
        other, other_shape = broadcast(other, other_term, other_shape)
        batch = [c for c in term if c in other_term and c in later]
        contracted = [c for c in term if c in other_term and c not in later]
        left = [c for c in term if c not in other_term]
        right = [c for c in other_term if c not in term]
        a = _arranged(w, name, term, batch + left + contracted)
        b = _arranged(w, other, other_term, batch + contracted + right)

        def prod(letters: list[str]) -> int:
            return int(np.prod([sizes[c] for c in letters], dtype=np.int64))

        a = w.op("Reshape", [a, w.const(np.array([prod(batch), prod(left), prod(contracted)], np.int64))])
        b = w.op("Reshape", [b, w.const(np.array([prod(batch), prod(contracted), prod(right)], np.int64))])
        product = w.op("MatMul", [a, b])
        term = "".join(batch + left + right)
        shape = [sizes[c] for c in term]
        name = w.op("Reshape", [product, w.const(np.array(shape, np.int64))])
    name, term, shape = summed(name, term, shape, set(output))
    name, shape = broadcast(name, term, shape)
    w.op("Identity", [_arranged(w, name, term, list(output))], node.output[0])
    return True


def _arranged(w: Writer, name: str, term: str, order: list[str]) -> str:
    if list(term) == order:
        return name
    return w.op("Transpose", [name], perm=[term.index(c) for c in order])


def _parse_einsum(equation: str, ranks: list[int]) -> tuple[list[str], str] | None:
    """The equation's operand terms and output term, `...` spelled out as fresh letters (the
    broadcast axes, right-aligned); None when it does not parse."""
    equation = equation.replace(" ", "")
    lhs, arrow, rhs = equation.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        return None
    used = set(equation) - set(".,->")
    spare = [c for c in string.ascii_uppercase + string.ascii_lowercase if c not in used]
    width = max((r - len(t.replace("...", "")) for t, r in zip(terms, ranks) if "..." in t), default=0)
    ellipsis = "".join(spare[:width])
    spelled = []
    for term, rank in zip(terms, ranks):
        if "..." in term:
            own = rank - len(term.replace("...", ""))
            term = term.replace("...", ellipsis[width - own :] if own else "")
        if len(term) != rank or not all(c.isalpha() for c in term):
            return None
        spelled.append(term)
    if arrow:
        output = rhs.replace("...", ellipsis)
    else:  # implicit: the broadcast axes, then every index seen once, in alphabetical order
        counts: dict[str, int] = {}
        for c in "".join(spelled):
            counts[c] = counts.get(c, 0) + 1
        output = ellipsis + "".join(sorted(c for c, n in counts.items() if n == 1 and c not in ellipsis))
    if not all(c.isalpha() for c in output) or not set(output) <= set("".join(spelled)):
        return None
    return spelled, output
