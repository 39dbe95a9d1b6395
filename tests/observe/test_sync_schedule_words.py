"""The report says when a local-update run syncs as the run was configured: a synchronous
warm-up and an interval that grows as the learning rate decays are named, and a warm-up
moves the first replica check to step 1 (its steps leave one model)."""

from gradsync.observe.sync_mode import first_drift_check, sync_schedule


def test_the_schedule_in_words_names_the_warmup_and_the_growing_interval():
    assert sync_schedule({"sync_every": 25}) == "syncs every 25 steps"
    assert sync_schedule({"sync_every": 25, "sync_warmup": 20}) == (
        "synchronous for the first 20 steps, then syncs every 25 steps")
    assert sync_schedule({"sync_every": 25, "sync_every_max": 100}) == (
        "syncs every 25 to 100 steps, further apart as the learning rate decays")


def test_the_first_replica_check_is_at_step_one_with_a_warmup():
    assert first_drift_check({"sync": "diloco", "sync_every": 25}) == 25
    assert first_drift_check({"sync": "diloco", "sync_every": 25, "sync_warmup": 20}) == 1
    assert first_drift_check({"sync": "streaming-diloco", "sync_every": 25}) is None
    assert first_drift_check({"sync": "streaming-diloco", "sync_warmup": 3}) == 1
    assert first_drift_check({"sync": "exact", "drift_every": 10}) == 10
