"""What the refusal of each kind of bad checkpoint file says (test_checkpoint*.py)."""
from __future__ import annotations

# kind: what the refusal of such a file must say (a regex), after its path
BAD_CAUSES = {
    "truncated": (r"not a complete checkpoint \(truncated, or not a file written by "
                  r"mpisync\.save\)"),
    "newer": (r"written in checkpoint format version 99 by mpisync .*; this mpisync "
              r"\(.*\) reads version 2 and older"),
    "other_model": r"the model does not match the checkpoint's",
    "not_a_checkpoint": r"not an mpisync checkpoint \(no format 'mpisync\.checkpoint'\)",
    "unreadable": r"not a readable checkpoint \(RuntimeError: .+\)",
    "missing": r"no such file",
    "no_model": r"a malformed mpisync checkpoint \(no 'model' entry\)",
    "no_optimizer": r"a malformed mpisync checkpoint \(no 'optimizer' entry\)",
    "no_strategy": (r"a malformed mpisync checkpoint \(table 'emb\.weight' has no 'strategy' "
                    r"entry\)"),
    "not_a_tensor": r"a malformed mpisync checkpoint \(AttributeError: .+\)",
}
