"""The batch runner and the policies on real sandboxes."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from sandpool.core import Outcome, RolloutResult, errors
from sandpool.core.backends.local import LocalBackend
from sandpool.envs.policies import ChatPolicy, NoopPolicy, OraclePolicy, get_policy
from sandpool.envs.runner import run_batch
from sandpool.envs.tasks import load_tasks, parse_task


async def test_oracle_resolves_and_noop_does_not(test_images_root, calc_task, tmp_path):
    results = tmp_path / "rollouts.jsonl"
    report = await run_batch([calc_task], [OraclePolicy(), NoopPolicy()], LocalBackend(test_images_root),
                             rollouts_per_task=4, concurrency=2, results_path=results)
    by = {r.policy: [] for r in report.rollouts}
    for r in report.rollouts:
        by[r.policy].append(r.reward)
    assert by == {"oracle": [1.0, 1.0], "noop": [0.0, 0.0]}
    assert report.failures == {"completed": 4, "infra_failed": 0, "task_failed": 0, "rejected": 0}
    assert report.unaccounted == 0
    assert report.ttfc.n == 4 and report.sandboxes_created <= 2 and report.resets >= 2
    assert len(results.read_text().splitlines()) == 4
    text = report.render_text()
    assert "TTFC" in text and "resolved 2" in text


async def test_resume_skips_finished_rollouts(test_images_root, calc_task, tmp_path):
    results = tmp_path / "rollouts.jsonl"
    await run_batch([calc_task], [OraclePolicy()], LocalBackend(test_images_root), rollouts_per_task=2,
                    concurrency=1, results_path=results)
    report = await run_batch([calc_task], [OraclePolicy()], LocalBackend(test_images_root),
                             rollouts_per_task=3, concurrency=1, results_path=results, resume=True)
    assert sorted(r.rollout for r in report.rollouts) == [0, 1, 2]
    assert report.ttfc.n == 1  # only the missing rollout ran


async def test_unknown_image_task_is_rejected_and_reported(test_images_root, calc_task):
    ghost = calc_task.model_copy(update={"instance_id": "ghost-1", "image": "sandpool.local/ghost:0"})
    report = await run_batch([calc_task, ghost], [OraclePolicy()], LocalBackend(test_images_root),
                             rollouts_per_task=1, concurrency=1)
    assert {(r.task_id, r.outcome) for r in report.rollouts} == {
        (calc_task.instance_id, Outcome.COMPLETED), ("ghost-1", Outcome.REJECTED)}
    assert report.rejected[0].task_id == "ghost-1" and "build-pack" in report.rejected[0].reason


async def test_a_broken_task_is_rejected_with_the_graders_reason_and_the_batch_goes_on(
        test_images_root, calc_task, tmp_path):
    bad = "diff --git a/nope.py b/nope.py\n--- a/nope.py\n+++ b/nope.py\n@@ -1 +1 @@\n-x\n+y\n"
    broken = calc_task.model_copy(update={"instance_id": "calc__broken-1", "test_patch": bad})
    results = tmp_path / "rollouts.jsonl"
    report = await run_batch([broken, calc_task], [OraclePolicy()], LocalBackend(test_images_root),
                             rollouts_per_task=2, concurrency=1, results_path=results)
    scored = [r for r in report.rollouts if r.reward is not None and r.task_id == "calc__broken-1"]
    assert scored == [], "a broken task must never be scored"
    assert [r.task_id for r in report.rejected] == ["calc__broken-1"]
    assert "test_patch does not apply to base" in report.rejected[0].reason
    assert sorted(r.reward for r in report.rollouts if r.task_id == calc_task.instance_id) == [1.0, 1.0]


async def test_a_policy_whose_patch_breaks_the_rules_is_task_failed_with_the_graders_reason(
        test_images_root, calc_task, tmp_path):
    from sandpool.envs.policies import Policy

    class PlantsAHook(Policy):  # the fix, and a pytest hook the patch policy refuses
        name = "hook"

        async def act(self, sandbox, task):
            await sandbox.write_file("calc.py", b"def add(a, b):\n    return a + b\n")
            await sandbox.write_file("conftest.py", b"import os\n")

    results = tmp_path / "rollouts.jsonl"
    report = await run_batch([calc_task], [PlantsAHook()], LocalBackend(test_images_root),
                             rollouts_per_task=1, concurrency=1, results_path=results)
    [r] = report.rollouts
    assert (r.outcome, r.reward, r.error_kind) == (Outcome.TASK_FAILED, 0.0, "patch_policy")
    assert r.error and "conftest.py" in r.error
    assert json.loads(results.read_text())["error"] == r.error


def test_malformed_rows_name_the_row_and_field(tmp_path, calc_task):
    good = calc_task.model_dump(mode="json")
    rows = [good, {**good, "instance_id": "b", "base_commit": "HEAD"}, {**good, "instance_id": "c"}]
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n{not json\n")
    with pytest.raises(errors.TaskValidationError, match=r"row 2 \(b\): field 'base_commit'.*40-character") as info:
        load_tasks(path)
    assert info.value.row == 2 and info.value.field == "base_commit"
    rejected = []
    tasks = load_tasks(path, rejected=rejected)
    assert [t.instance_id for t in tasks] == [calc_task.instance_id, "c"]
    assert [r.row for r in rejected] == [2, 4] and "not valid JSON" in rejected[1].reason


class _ScriptedChat(BaseHTTPRequestHandler):
    """An OpenAI-compatible endpoint that replies with a fixed script of messages."""

    script: list[str] = []
    seen: list[dict] = []

    def do_POST(self):  # noqa: N802 - http.server's naming
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _ScriptedChat.seen.append(body)
        content = _ScriptedChat.script[min(len(body["messages"]) // 2 - 1, len(_ScriptedChat.script) - 1)]
        data = json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


async def test_chat_policy_drives_the_sandbox_over_http(test_images_root, calc_task):
    _ScriptedChat.script = ["Let me fix it.\n```bash\nsed -i 's/a - b/a + b/' calc.py\n```", "SUBMIT"]
    server = HTTPServer(("127.0.0.1", 0), _ScriptedChat)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    policy = get_policy("chat", base_url=f"http://127.0.0.1:{server.server_port}/v1", model="m")
    assert isinstance(policy, ChatPolicy)
    try:
        report = await run_batch([calc_task], [policy], LocalBackend(test_images_root),
                                 rollouts_per_task=1, concurrency=1)
    finally:
        await policy.aclose()
        server.shutdown()
        server.server_close()
    assert report.rollouts[0].outcome is Outcome.COMPLETED and report.rollouts[0].reward == 1.0
    assert _ScriptedChat.seen[0]["messages"][1]["content"] == calc_task.problem_statement
    assert "exit code 0" in _ScriptedChat.seen[1]["messages"][-1]["content"]


async def test_unreachable_chat_endpoint_is_task_failed(test_images_root, calc_task):
    policy = ChatPolicy("http://127.0.0.1:9/v1", "m", request_timeout=2)
    report = await run_batch([calc_task], [policy], LocalBackend(test_images_root),
                             rollouts_per_task=1, concurrency=1)
    await policy.aclose()
    assert report.rollouts[0].outcome is Outcome.TASK_FAILED


def _write_rows(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


async def test_a_base_commit_not_in_the_image_rejects_that_task_only(test_images_root, calc_task, tmp_path):
    good = calc_task.model_dump(mode="json")
    bad_sha = {**good, "instance_id": "calc-bad-sha", "base_commit": "ab" * 20}
    ghost = {**good, "instance_id": "calc-ghost", "image": "sandpool.local/ghost:0"}
    path = _write_rows(tmp_path / "tasks.jsonl", [good, bad_sha, "{torn", ghost])
    rejected, rows = [], {}
    tasks = load_tasks(path, rejected=rejected, rows=rows)
    seen = []
    report = await run_batch(tasks, [OraclePolicy()], LocalBackend(test_images_root), rollouts_per_task=2,
                             concurrency=2, rejected=rejected, rows=rows, on_result=seen.append)
    # 4 rows x 2 rollouts requested; only the good row ran, the batch went on past the others.
    assert report.workload.tasks == 4 and report.workload.rollouts == 8
    assert report.failures == {"completed": 2, "infra_failed": 0, "task_failed": 0, "rejected": 6}
    assert report.unaccounted == 0 and len(seen) == 8  # the progress bar ends at 8/8
    by_row = {r.row: r.reason for r in report.rejected}
    assert set(by_row) == {2, 3, 4}
    assert "is not a commit of image" in by_row[2] and "not valid JSON" in by_row[3]
    assert "build-pack" in by_row[4]
    assert {r.task_id for r in report.rejected} == {"calc-bad-sha", None, "calc-ghost"}
    assert all(r.reward is None for r in report.rollouts if r.outcome is Outcome.REJECTED)
    assert "rejected 6 = 8 of 8 requested" in report.render_text()
    assert "row 4 (calc-ghost): " in report.render_text()
    # The bad sha's claim was served (warm), then rejected at its checkout: not a claim.
    assert report.pool.claims == 2 and report.pool.warm_hits <= report.pool.claims


async def test_a_torn_journal_line_is_dropped_and_named_on_resume(test_images_root, calc_task, tmp_path):
    results = tmp_path / "rollouts.jsonl"
    await run_batch([calc_task], [OraclePolicy()], LocalBackend(test_images_root), rollouts_per_task=2,
                    concurrency=1, results_path=results)
    lines = results.read_text().splitlines()
    results.write_text(lines[0] + "\n" + lines[1][: len(lines[1]) // 2])  # killed mid-write
    report = await run_batch([calc_task], [OraclePolicy()], LocalBackend(test_images_root),
                             rollouts_per_task=2, concurrency=1, results_path=results, resume=True)
    assert sorted(r.rollout for r in report.rollouts) == [0, 1] and report.unaccounted == 0
    assert report.ttfc.n == 1 and len(report.warnings) == 1 and "line 2 dropped" in report.warnings[0]
    assert [json.loads(x)["rollout"] for x in results.read_text().splitlines()] == [0, 1]
    assert (tmp_path / "rollouts.jsonl.torn").read_text() == lines[1][: len(lines[1]) // 2] + "\n"


async def test_resume_on_a_journal_of_another_run_counts_only_the_requested_rollouts(
        test_images_root, calc_task, tmp_path):
    results = tmp_path / "rollouts.jsonl"
    ran = [RolloutResult(task_id=calc_task.instance_id, rollout=i, outcome=Outcome.COMPLETED,
                         reward=1.0, policy="oracle") for i in range(3)]
    ran.append(RolloutResult(task_id="another-task", rollout=0, outcome=Outcome.COMPLETED,
                             reward=0.0, policy="noop"))
    results.write_text("".join(r.model_dump_json() + "\n" for r in ran))  # 3 rollouts + a task
    report = await run_batch([calc_task], [OraclePolicy()], LocalBackend(test_images_root),
                             rollouts_per_task=1, concurrency=1, results_path=results, resume=True)
    assert [(r.task_id, r.rollout) for r in report.rollouts] == [(calc_task.instance_id, 0)]
    assert report.failures["completed"] == 1 and report.unaccounted == 0
    assert report.ttfc.n == 0  # rollout 0 was journaled: nothing ran
    assert "= 1 of 1 requested" in report.render_text() and "UNACCOUNTED" not in report.render_text()
    assert len(report.warnings) == 1 and "3 journaled result(s) are not part of this run" in report.warnings[0]
    assert len(results.read_text().splitlines()) == 4  # the other run's results are kept

    other = calc_task.model_copy(update={"instance_id": "calc__calc-2"})  # another task set
    report = await run_batch([other], [OraclePolicy()], LocalBackend(test_images_root),
                             rollouts_per_task=1, concurrency=1, results_path=results, resume=True)
    assert [(r.task_id, r.outcome) for r in report.rollouts] == [("calc__calc-2", Outcome.COMPLETED)]
    assert report.unaccounted == 0 and report.ttfc.n == 1
    assert "4 journaled result(s) are not part of this run" in report.warnings[0]
