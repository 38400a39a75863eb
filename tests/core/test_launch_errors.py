"""The launcher names the failure that caused a job's end, not a peer's symptom of it."""

from fireflyer.launch import _first_error


def test_the_cause_wins_over_a_broken_pipe_on_an_earlier_node(tmp_path):
    (tmp_path / "node0.log").write_text("step 1\nTraceback (most recent call last):\n"
                                        "BrokenPipeError: [Errno 32] Broken pipe\n")
    (tmp_path / "node1.log").write_text("step 1\n[rank1]: RuntimeError: injected failure on rank 1 at step 3\n")
    assert _first_error(tmp_path) == "RuntimeError: injected failure on rank 1 at step 3"


def test_a_symptom_is_still_named_when_it_is_all_there_is(tmp_path):
    (tmp_path / "node0.log").write_text("ConnectionResetError: [Errno 104] Connection reset by peer\n")
    assert "ConnectionResetError" in _first_error(tmp_path)
    assert _first_error(tmp_path / "none") == "no error message; see the logs"


def test_a_fireflyer_error_whose_name_does_not_end_in_error_is_the_cause(tmp_path):
    (tmp_path / "node0.log").write_text("[rank0]: fireflyer.storage.errors.CorruptRecord: record 7 (at offset 231 "
                                        "of shard shard-00000.rec) fails its CRC-32 checksum\n")
    (tmp_path / "node1.log").write_text("[rank1]: fireflyer.hfreduce.errors.PeerFailure: rank 0 is gone\n"
                                        "fireflyer train: 2 node(s) x 1 rank(s)\n")
    assert _first_error(tmp_path).startswith("fireflyer.storage.errors.CorruptRecord: record 7 (at offset 231")
