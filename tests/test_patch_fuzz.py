"""Any text as the policy's patch is parsed or refused as the policy's (``PatchError``).

The captured patch is what git printed in the sandbox the policy held (in an OCI sandbox
whose ``/usr`` it may write, the policy's own git), so :func:`parse_patch` meets any text.
An exception other than ``PatchError`` would end the rollout as an error sandpool does not
know (infra: unscored).
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandpool.envs.grading.patch import PatchError, parse_patch

NUM = st.one_of(st.sampled_from(["9" * 5000, "0", "1", "-1", "18446744073709551616"]),
                st.text(alphabet="0123456789", min_size=1, max_size=6))
PATH = st.one_of(st.sampled_from(["a/x.py", "b/x.py", '"a/\\444"', '"b/\\"', "/dev/null", "a/",
                                  "a/x y.py", '"a/\\t\\n"']), st.text(max_size=12))
LINE = st.one_of(
    st.builds(lambda a, b: f"diff --git {a} {b}", PATH, PATH),
    st.builds(lambda a: f"--- {a}", PATH), st.builds(lambda b: f"+++ {b}", PATH),
    st.builds(lambda a, b, c, d: f"@@ -{a},{b} +{c},{d} @@", NUM, NUM, NUM, NUM),
    st.builds(lambda a, c: f"@@ -{a} +{c} @@ ctx", NUM, NUM),
    st.builds(lambda k, m: f"{k} {m}", st.sampled_from(["old mode", "new mode", "new file mode",
                                                        "deleted file mode", "index", "similarity index",
                                                        "rename from", "rename to", "copy from"]),
              st.one_of(NUM, st.text(max_size=10))),
    st.sampled_from(["GIT binary patch", "literal 5", "delta 3", "zcmZ?wbhEHbHe", "Binary files a/x and b/x differ",
                     "\\ No newline at end of file", " ctx", "+add", "-del", ""]),
    st.text(max_size=40),
)

#: A file's block as git writes it, its numbers and body drawn: the parse reaches each part.
BLOCK = st.builds(
    lambda hdr, hunk, body: ["diff --git a/x.py b/x.py", *hdr, "--- a/x.py", "+++ b/x.py", hunk, *body],
    st.lists(st.sampled_from(["index 0000000..1111111 100644", "old mode 100644", "new mode 100755",
                              "new file mode 100644", "deleted file mode 100644"]), max_size=2),
    st.one_of(st.builds(lambda a, b, c, d: f"@@ -{a},{b} +{c},{d} @@", NUM, NUM, NUM, NUM),
              st.builds(lambda a, c: f"@@ -{a} +{c} @@", NUM, NUM)),
    st.lists(st.sampled_from([" ctx", "+add", "-del", "\\ No newline at end of file", ""]), max_size=6))


@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.one_of(BLOCK, st.lists(LINE, max_size=4)), max_size=4), st.booleans())
def test_any_patch_text_is_parsed_or_refused_as_the_policys(parts, trailing):
    text = "\n".join(line for part in parts for line in part) + ("\n" if trailing else "")
    try:
        changes = parse_patch(text)
    except PatchError:
        return
    assert isinstance(changes, list)
