"""A minimal trampoline (written for vpager's ComfyUI test client; torchsde
imports this name).

trampoline(gen) runs the generator `gen` without recursion: a generator may
`yield` another generator to call it (the callee's return value is sent
back in), or `raise TailCall(other)` to be replaced by `other`. Returns the
value the outermost generator returns."""

import types

__all__ = ["trampoline", "TailCall"]


class TailCall(BaseException):
    def __init__(self, call):
        super().__init__(call)
        self.call = call


def trampoline(gen):
    stack = [gen]
    value, error = None, None
    while stack:
        top = stack[-1]
        try:
            if error is not None:
                e, error = error, None
                step = top.throw(e)
            else:
                step = top.send(value)
        except StopIteration as stop:
            stack.pop()
            value = stop.value
            continue
        except TailCall as tail:
            stack[-1] = tail.call
            value = None
            continue
        except BaseException as e:
            stack.pop()
            if not stack:
                raise
            error = e
            continue
        if not isinstance(step, types.GeneratorType):
            raise TypeError("trampoline: a generator yields a generator to "
                            "call it, not %r" % type(step).__name__)
        stack.append(step)
        value = None
    return value
