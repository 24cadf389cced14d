#!/usr/bin/env bash
# Plant known bugs in the engine, one at a time, and show that the reliability
# suites catch each one (issue 4: "each suite demonstrably fails on a planted bug").
#
#   bash tests/planted_bugs.sh            # every bug
#   bash tests/planted_bugs.sh 3 5        # only bugs 3 and 5
#
# Each bug is a literal text replacement in one engine file (checked to apply),
# the named suite runs, and the file is restored with `git checkout` (also on
# Ctrl-C). The suite must FAIL; the script exits non-zero if any bug went unseen.
# Needs a clean `asyncsave/` (it refuses to run over uncommitted engine changes).
# A missing fsync is invisible to SIGKILL (the page cache survives): bugs 1-3 and
# 16 are for the power-loss suite, which is the one that sees them.
set -uo pipefail
cd "$(dirname "$0")/.."
if ! git diff --quiet -- asyncsave; then
    echo "asyncsave/ has uncommitted changes; commit or stash them first" >&2
    exit 2
fi
trap 'git checkout -q -- asyncsave' EXIT INT TERM
export ASYNCSAVE_CRASH_BACKENDS=asyncio ASYNCSAVE_CRASH_RUNS=200

# id | file | text to find | replacement | pytest selection
BUGS=(
"1|asyncsave/_atomicity.py|    fs.fsync_dir(tmp)\n    if overwrite|    if overwrite|tests/test_power_loss.py"
"2|asyncsave/_atomicity.py|        fs.rename(tmp, final)\n    fs.fsync_dir(final.parent)|        fs.rename(tmp, final)|tests/test_power_loss.py"
"3|asyncsave/_write.py|            digests = _write_direct(fs, fd, dfd, view, layout, entries, on_written, known, follow)\n        fs.fsync(fd)\n    except BaseException:|            digests = _write_direct(fs, fd, dfd, view, layout, entries, on_written, known, follow)\n    except BaseException:|tests/test_power_loss.py"
"4|asyncsave/_phases.py|            self.committing = True\n|            self.committing = True\n            await self.saver.track(self.step)\n|tests/test_crash_matrix.py -k every_call"
"5|asyncsave/_commit.py|        if is_temp_name(name) and _remove_unless_held(|        if False and _remove_unless_held(|tests/test_crash_matrix.py -k every_call"
"6|asyncsave/_retention.py|            fs.rename(final, doomed)\n        except OSError|            doomed = final\n        except OSError|tests/test_crash_matrix.py -k every_call"
"7|asyncsave/_pipeline.py|    def fail(self, handle: SaveHandle, error: SaveFailedError) -> None:\n        self.set_failure(error)|    def fail(self, handle: SaveHandle, error: SaveFailedError) -> None:\n        pass|tests/test_io_faults.py"
"8|asyncsave/_atomicity.py|    try:\n        if fs.lexists(path):\n            fs.remove_tree(path)|    try:\n        if False:\n            fs.remove_tree(path)|tests/test_io_faults.py"
"9|asyncsave/_pipeline.py|    except BaseException as exc:\n        raise WorkerDiedError|    except ZeroDivisionError as exc:\n        raise WorkerDiedError|tests/test_hangs.py -k dies"
"10|asyncsave/_phases.py|                with anyio.fail_after(saver.options.save_timeout_s):|                with anyio.fail_after(None):|tests/test_hangs.py -k stuck"
"11|asyncsave/_decode.py|        if name != \"__metadata__\" and not _well_formed(h):|        if False:|tests/test_bad_inputs.py"
"12|asyncsave/_manifest.py|        and \"/\" not in name\n|\n|tests/test_bad_inputs.py"
"13|asyncsave/_track.py|    text = raw.decode(\"ascii\", errors=\"replace\").strip()|    text = raw.decode(\"ascii\", errors=\"replace\").strip().lstrip(\"+-\")|tests/test_fuzz_parsers.py"
"14|asyncsave/_manifest.py|def _self_checksum_ok(raw: bytes, doc: dict[str, Any], digest: Any) -> bool:\n|def _self_checksum_ok(raw: bytes, doc: dict[str, Any], digest: Any) -> bool:\n    return True\n|tests/test_fuzz_parsers.py"
"15|asyncsave/_phases.py|            self.committing = True\n|            self.committing = True\n            await self.saver.track(self.step)\n|tests/test_crash_matrix.py -k randomized"
"16|asyncsave/_retention.py|            fs.rename(final, doomed)\n        except OSError|            doomed = final\n        except OSError|tests/test_power_loss.py -k retention"
# Incremental saves (issue 14): the early writes' failure dropped; a failure while
# hashing not waiting for the early writes before the clean-up.
"17|asyncsave/_jobs.py|        if not early.ok:\n            raise early.error or CheckpointError(|        if False:\n            raise early.error or CheckpointError(|tests/test_incremental_overlap.py -k failed_early"
"18|asyncsave/_jobs.py|            with anyio.CancelScope(shield=True):\n                await early.done.wait()\n        if early.error is not None and|            pass\n        if early.error is not None and|tests/test_incremental_overlap.py -k failure_while_hashing"
# ... and a cancelled save not waiting for its hashing workers before its clean-up.
"19|asyncsave/_jobs.py|            if self.running.any():|            if False:|tests/test_incremental_overlap.py -k waits_for_its_hashing"
# Writing while staging (overlap_writes, issue 11): a writer that does not wait
# for its chunk to be staged (inline checksums; the O_DIRECT writer whose helper
# hashes); a rank's files written early left in its own directory; a save that
# follows its staging while an earlier save is still pending; the entry of the
# directory it writes into not made durable before files are renamed out of it.
"20|asyncsave/_write.py|        if ready is not None:\n            ready(stop)\n        p = pos|        p = pos|tests/test_overlap_writes.py -k random_layouts"
"21|asyncsave/_write.py|            if ready is not None:\n                ready(stop)\n            sink(view[pos:stop], pos)|            sink(view[pos:stop], pos)|tests/test_overlap_writes.py -k written_before"
"22|asyncsave/_jobs.py|        if early is not None and early.tmp != tmp:|        if False:|tests/test_overlap_writes.py -k two_ranks"
"23|asyncsave/_jobs.py|(self.always or self.lazy) and _none_unfinished_before(saver.pending, step)|(self.always or self.lazy) and True|tests/test_overlap_writes.py -k pending"
"24|asyncsave/_dispatch.py|        await saver.run(saver.fs.fsync_dir, private.parent)\n|\n|tests/test_power_loss.py -k overlap"
"25|asyncsave/_stage.py|        bool(plan.buffer_storages)\n        or|        False\n        or|tests/test_lazy.py -k reused_plan"
"26|asyncsave/_replan.py|        if t not in _PLAIN_CONTAINERS:\n            return False|        if t not in _PLAIN_CONTAINERS:\n            continue|tests/test_many_tensors.py -k not_small"
"27|asyncsave/_replan.py|        if seen + len(stack) + len(obj) + (meta is not None) > INLINE_PLAN_MAX_NODES:\n            return False\n|\n|tests/test_many_tensors.py -k node_limit"
# Matching instead of flattening: the skeleton not rebuilt after a change of the
# tree alone (every later save walked twice); a Stateful object's state_dict()
# results kept one per object, not one per occurrence.
"28|asyncsave/_replan.py|                last.skeleton = Skeleton.of(flat.tree, last.skeleton.signatures)|                pass|tests/test_skeleton.py -k tree_only"
"29|asyncsave/_skeleton.py|        kept.append(sd)\n        return sd|        kept[:] = [sd]\n        return sd|tests/test_skeleton.py -k reached_twice"
# The memory tier's restart: the trainer resumes before its saver starts only
# when no saver of the root is alive (a dead trainer's still committing); the
# step it resumed from is protected in the saver.
"30|asyncsave/_memtier.py|            return await anyio.to_thread.run_sync(_no_saver_alive, self._home, rank)|            return True|tests/test_memory_tier.py -k waits_for_the_dead"
"31|asyncsave/_saverproc.py|            protect_resumed(ckpt._saver, resumed[0], local=resumed[1] == \"local\")|            pass|tests/test_memory_tier.py -k before_its_saver"
# The memory tier's packing, reused while the tensors' signatures hold: a bool
# tensor copied as itself (copy_ makes every non-zero byte 1); the layout
# reused without comparing the signatures.
"32|asyncsave/_slots.py|                and t.dtype in PLAIN_DTYPES\n|                and True\n|tests/test_memory_tier.py -k reused_layout"
"33|asyncsave/_slots.py|        and same_signature(last.signatures, signatures)\n|        and len(last.signatures) == len(signatures)\n|tests/test_memory_tier.py -k reused_layout"
# Numbers out of the memory tier's tree (a changed step does not make the saver
# decide again); training_info refused by the trainer's save(), early or not.
"34|asyncsave/_slots.py|        if type(obj) in _NUMBERS:|        if False:|tests/test_memory_tier.py -k numbers_changed"
"35|asyncsave/_memtier.py|        check_training_info(training_info, step)\n|\n|tests/test_memory_tier.py -k numbers_changed"
# Loads read ahead while the manifest is parsed; lazy saves' early copies into a
# reused buffer (tests/test_load_fast.py, tests/test_lazy.py).
"36|asyncsave/_load.py|        ahead.stop()\n|\n|tests/test_load_fast.py -k stops_its_read_ahead"
"37|asyncsave/_fs.py|        return os.sendfile(sink, fd, offset, READ_AHEAD_CHUNK)|        return 0|tests/test_load_fast.py -k whole_and_nothing_else"
"38|asyncsave/_stage.py|                torch._foreach_copy_(self._views[i : i + step], srcs[i : i + step])  # type: ignore[arg-type]|                pass|tests/test_lazy.py -k repeated_lazy_saves"
"39|asyncsave/_stage.py|            if self._holder is not None:\n                return False|            pass|tests/test_lazy.py -k repeated_lazy_saves"
# The same bugs of the one pipeline, caught on 2 ranks (issue 11).
"4r|asyncsave/_phases.py|            self.committing = True\n|            self.committing = True\n            await self.saver.track(self.step)\n|tests/test_crash_ranks.py"
"5r|asyncsave/_commit.py|        if is_temp_name(name) and _remove_unless_held(|        if False and _remove_unless_held(|tests/test_crash_ranks.py"
"7r|asyncsave/_pipeline.py|    def fail(self, handle: SaveHandle, error: SaveFailedError) -> None:\n        self.set_failure(error)|    def fail(self, handle: SaveHandle, error: SaveFailedError) -> None:\n        pass|tests/test_dist.py -k failing_rank"
"8r|asyncsave/_atomicity.py|    try:\n        if fs.lexists(path):\n            fs.remove_tree(path)|    try:\n        if False:\n            fs.remove_tree(path)|tests/test_dist.py -k failing_rank"
)

wanted=" $* "
unseen=0
for bug in "${BUGS[@]}"; do
    IFS='|' read -r id file find replace suite <<<"$bug"
    if [[ $# -gt 0 && "$wanted" != *" $id "* ]]; then continue; fi
    python3 - "$file" "$find" "$replace" <<'EOF' || { echo "bug $id: pattern not found in $2"; exit 2; }
import sys
path, find, replace = sys.argv[1], sys.argv[2].replace("\\n", "\n"), sys.argv[3].replace("\\n", "\n")
text = open(path).read()
if text.count(find) != 1:
    sys.exit(1)
open(path, "w").write(text.replace(find, replace))
EOF
    start=$(date +%s)
    # shellcheck disable=SC2086
    python -m pytest -q -x -p no:cacheprovider $suite >"/tmp/planted-bug-$id.log" 2>&1
    rc=$?
    secs=$(( $(date +%s) - start ))
    first=$(grep -m1 -E '^(FAILED|ERROR)' "/tmp/planted-bug-$id.log" | cut -c1-150)
    if [[ $rc -ne 0 ]]; then
        echo "bug $id ($file): CAUGHT by $suite in ${secs}s: ${first}"
    else
        echo "bug $id ($file): NOT caught by $suite (${secs}s)"
        unseen=$((unseen + 1))
    fi
    git checkout -q -- "$file"
done
exit $unseen
