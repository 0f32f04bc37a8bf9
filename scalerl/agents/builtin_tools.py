"""Tools shipped with scalerl, by name (`task.environment.tools`).

Each is a stdlib-only, self-contained function (its imports inside), because its source is
what runs in the code sandbox (`scalerl.agents.tools.FunctionTool`).
"""

from __future__ import annotations


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: integers and decimals, + - * / // % ** and
    parentheses. Returns the value, or an error message.

    Example: {"expression": "(17 + 4) * 23"} -> "483"."""
    import ast
    import operator

    binary = {
        ast.Add: operator.add,
        ast.Sub: operator.sub,
        ast.Mult: operator.mul,
        ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod,
        ast.Pow: operator.pow,
    }
    unary = {ast.USub: operator.neg, ast.UAdd: operator.pos}

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in binary:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return binary[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in unary:
            return unary[type(node.op)](value(node.operand))
        raise ValueError("only numbers, + - * / // % ** and parentheses")

    if len(expression) > 200:
        return "error: expression longer than 200 characters"
    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as exc:
        return f"error: {exc}"
    if isinstance(result, float) and result.is_integer():
        result = int(result)
    return str(result)


BUILTIN_TOOLS = {"calculator": calculator}
