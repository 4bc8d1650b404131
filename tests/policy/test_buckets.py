"""Key buckets (policy/buckets.py): pinned where a key was served, never moved by another
key, new keys sent to the pods under their share, and each bucket no pod holds offered to
one of them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set

from xds_server.policy.buckets import (
    BucketHomes,
    BucketMemory,
    FollowedBuckets,
    bucket_homes,
    followed_buckets,
)
from xds_server.tuning import Tuning

PODS = ("a:1", "b:1", "c:1", "d:1")
BUCKETS = 256
NO_PINS = BucketMemory()
POINTS = Tuning().key_offer_points
# A width narrower than the pods, so that the ring's choice shows.
WIDTH = 2


def _key(bucket: int, n: int = 0) -> int:
    """A key hash in `bucket`."""
    return bucket + BUCKETS * (n + 1)


def _homes(
    keys: Mapping[int, float] | None,
    served: Mapping[int, str] | None,
    memory: BucketMemory = NO_PINS,
    *,
    healthy: Sequence[str] = PODS,
    known: Set[str] = frozenset(PODS),
    shares: Mapping[str, float] | None = None,
    spilling: Set[str] = frozenset(),
    prior: float = 0.0,
    slack: float = 0.0,
    width: int = WIDTH,
    first_requests: Mapping[str, int] | None = None,
) -> BucketHomes:
    return bucket_homes(
        known,
        healthy,
        shares if shares is not None else dict.fromkeys(known, 1.0),
        keys,
        served,
        spilling,
        memory,
        buckets=BUCKETS,
        key_prior=prior,
        offer_points=POINTS,
        offer_width=width,
        spare_slack=slack,
        first_requests=first_requests,
    )


def _offered(table: BucketHomes) -> dict[int, frozenset[str]]:
    """Each offered bucket's spares."""
    offered: dict[int, set[str]] = {}
    for pod, held in table.offers.items():
        for bucket in held:
            offered.setdefault(bucket, set()).add(pod)
    return {b: frozenset(pods) for b, pods in offered.items()}


def test_before_any_key_every_pod_takes_new_keys() -> None:
    table = _homes(None, None)
    assert table.spares == frozenset(PODS)
    assert table.buckets == {}
    # Each bucket offered to WIDTH pods, each pod about WIDTH quarters of them.
    offered = _offered(table)
    assert sorted(offered) == list(range(BUCKETS))
    assert {len(pods) for pods in offered.values()} == {WIDTH}
    shares = [len(table.offers[pod]) / BUCKETS for pod in PODS]
    assert all(abs(share - WIDTH / 4) <= WIDTH / 4 * 0.3 for share in shares), shares


def test_a_width_of_one_offers_each_bucket_to_one_pod_and_a_wide_one_to_all() -> None:
    narrow = _offered(_homes(None, None, width=1))
    assert {len(pods) for pods in narrow.values()} == {1}
    # Every spare: listed nowhere, Envoy's default subset (the spares) takes them.
    wide = _homes(None, None, width=len(PODS))
    assert wide.offers == {} and wide.spares == frozenset(PODS)


def test_by_default_every_pod_not_spilling_takes_every_new_key() -> None:
    """By default every pod that does not spill is a spare, even one ahead of its share,
    and the buckets no pod holds are listed nowhere: Envoy's default subset, the spares,
    sends a new key to the one with the fewest in flight."""
    tuning = Tuning()
    keys = {_key(3): 1.0, _key(7): 1.0, _key(9): 1.0}
    table = _homes(
        keys,
        {_key(3): "a:1", _key(7): "a:1", _key(9): "a:1"},
        spilling={"d:1"},
        slack=tuning.key_spare_slack,
        width=tuning.key_offer_width,
    )
    assert table.buckets == {"a:1": (3, 7, 9)}
    assert table.spares == frozenset({"a:1", "b:1", "c:1"})
    assert table.offers == {}


def test_buckets_no_pod_holds_are_offered_to_the_spares_only() -> None:
    """Pinned buckets are not offered; the others go to the spares, none to a pod ahead
    of its share; a pod's pins out of rotation are offered meanwhile."""
    memory = BucketMemory(pins={3: "c:1", 7: "a:1", 9: "b:1"})
    keys = {_key(3): 4.0, _key(7): 4.0, _key(9): 4.0}
    table = _homes(keys, {}, memory, healthy=("a:1", "b:1", "d:1"))
    assert table.spares == frozenset({"d:1"})
    # The one spare is every spare: the buckets never pinned are listed nowhere (the
    # default subset, the spares, takes them), and the one whose pod is out waits on it.
    assert _offered(table) == {3: frozenset({"d:1"})}
    # Wider than one spare, each is offered to WIDTH of them.
    table = _homes(keys, {}, memory, healthy=("a:1", "b:1", "d:1"), slack=100.0)
    offered = _offered(table)
    assert set(offered) == set(range(BUCKETS)) - {7, 9}
    assert {len(pods) for b, pods in offered.items() if b != 3} == {WIDTH}
    assert all(pods <= table.spares for pods in offered.values())


def test_a_spare_that_goes_moves_only_its_own_offers() -> None:
    """The ring depends on the spares alone: when one leaves (it took a key), every
    bucket it was not offered keeps its spares, and each of its buckets keeps the others
    and takes one more."""
    for width in (1, WIDTH):
        before = _offered(_homes(None, None, width=width))
        gone = min(before[5])
        after_table = _homes({_key(5): 1.0}, {_key(5): gone}, width=width)
        after = _offered(after_table)
        assert gone not in after_table.spares and 5 not in after
        for bucket, pods in before.items():
            if bucket == 5:
                continue
            if gone in pods:
                assert after[bucket] > pods - {gone} and len(after[bucket]) == width
            else:
                assert after[bucket] == pods


def test_a_follower_offers_what_its_leader_offers() -> None:
    memory = BucketMemory(pins={3: "c:1", 7: "a:1"})
    keys = {_key(3): 4.0, _key(7): 4.0}
    leader = _homes(keys, {}, memory)
    followed = followed_buckets(
        frozenset(PODS),
        PODS,
        FollowedBuckets(buckets=leader.buckets, spares=leader.spares),
        buckets=BUCKETS,
        offer_points=POINTS,
        offer_width=WIDTH,
    )
    assert followed.offers == leader.offers
    assert followed.buckets == leader.buckets


def test_a_bucket_is_pinned_where_its_key_was_served() -> None:
    keys = {_key(3): 1.0, _key(7): 1.0}
    table = _homes(keys, {_key(3): "c:1", _key(7): "a:1"})
    assert table.buckets == {"c:1": (3,), "a:1": (7,)}
    assert table.memory.pins == {3: "c:1", 7: "a:1"}
    # Pods ahead of their share take no new key.
    assert table.spares == frozenset({"b:1", "d:1"})


def test_a_pin_stays_whatever_the_load_does() -> None:
    """A heavy key's pod carries more than its share: its bucket stays, it just takes no
    new key."""
    memory = BucketMemory(pins={3: "c:1", 7: "a:1"})
    keys = {_key(3): 50.0, _key(7): 1.0}
    served = {_key(3): "d:1", _key(7): "a:1"}  # the heavy key's last request spilled to d
    table = _homes(keys, served, memory)
    assert table.memory.pins == {3: "c:1", 7: "a:1"}
    assert "c:1" not in table.spares


def test_a_pod_out_of_rotation_keeps_its_pins_unlisted_until_it_is_back() -> None:
    """Its keys go to the spares meanwhile; a pod that leaves the pool loses its pins,
    and its keys are pinned where a pod in rotation serves them next."""
    memory = BucketMemory(pins={3: "c:1", 7: "a:1"})
    keys = {_key(3): 4.0, _key(7): 4.0}
    served = {_key(3): "b:1", _key(7): "a:1"}
    healthy = ("a:1", "b:1", "d:1")
    out = _homes(keys, served, memory, healthy=healthy)
    assert out.memory.pins == {3: "c:1", 7: "a:1"}
    assert out.buckets == {"a:1": (7,)}
    back = _homes(keys, served, out.memory)
    assert back.buckets == {"a:1": (7,), "c:1": (3,)}
    gone = _homes(keys, served, memory, healthy=healthy, known=frozenset(healthy))
    assert gone.memory.pins == {3: "b:1", 7: "a:1"}


def test_a_key_served_by_no_pod_in_rotation_stays_unpinned() -> None:
    """Seen only through the spill listener (no pod logged), or last served by a pod no
    longer in rotation (a key an earlier fleet left): pinning it anywhere would move it.
    Its next request goes to a spare, which it is then pinned to."""
    table = _homes({_key(20): 1.0, _key(21): 1.0}, {_key(21): "gone:1"})
    assert table.memory.pins == {}
    assert table.spares == frozenset(PODS)


def test_forgotten_keys_free_their_bucket() -> None:
    memory = BucketMemory(pins={3: "c:1", 7: "a:1"})
    table = _homes({_key(7): 1.0}, {}, memory)  # the key of bucket 3 was forgotten
    assert table.memory.pins == {7: "a:1"}


def test_keys_of_one_bucket_go_where_its_heaviest_served_in_rotation_went() -> None:
    keys = {_key(5, 0): 1.0, _key(5, 1): 3.0, _key(5, 2): 9.0}
    served = {_key(5, 0): "a:1", _key(5, 1): "b:1", _key(5, 2): "gone:1"}
    assert _homes(keys, served).memory.pins == {5: "b:1"}


def test_spares_follow_capacity_and_leave_spilling_pods_out() -> None:
    """A pod with twice the capacity takes new keys until it carries twice as much; a pod
    spilling takes none while another can."""
    shares = {"a:1": 2.0, "b:1": 1.0, "c:1": 1.0}
    pods = tuple(shares)
    memory = BucketMemory(pins={1: "a:1", 2: "b:1", 3: "c:1"})
    keys = {_key(1): 2.0, _key(2): 1.0, _key(3): 1.0}

    def spares(spilling: Set[str]) -> frozenset[str]:
        return _homes(
            keys, {}, memory, healthy=pods, known=set(pods), shares=shares, spilling=spilling
        ).spares

    assert spares(frozenset()) == frozenset(pods)
    assert spares({"a:1"}) == frozenset({"b:1", "c:1"})
    assert spares(set(pods)) == frozenset(pods)


def test_new_keys_pass_over_the_pods_that_took_more_first_requests_lately() -> None:
    """Of the spares, those with the fewest first requests of keys lately stay: a new key
    queues behind another's whole prefill. Never none: when every spare took as many, all
    stay; a spilling pod stays out whatever it took."""
    tuning = Tuning()

    def spares(firsts: Mapping[str, int], spilling: Set[str] = frozenset()) -> frozenset[str]:
        return _homes(
            {},
            {},
            spilling=spilling,
            slack=tuning.key_spare_slack,
            width=tuning.key_offer_width,
            first_requests=firsts,
        ).spares

    assert spares({}) == frozenset(PODS)
    assert spares({"a:1": 1}) == frozenset({"b:1", "c:1", "d:1"})
    assert spares({"a:1": 2, "b:1": 1, "c:1": 1, "d:1": 1}) == frozenset({"b:1", "c:1", "d:1"})
    assert spares(dict.fromkeys(PODS, 1)) == frozenset(PODS)
    assert spares({"b:1": 1, "c:1": 1}, spilling={"a:1"}) == frozenset({"d:1"})
    assert spares({"d:1": 1}, spilling={"a:1", "b:1", "c:1"}) == frozenset({"d:1"})


def test_a_keys_first_counts_weigh_little_beside_the_prior() -> None:
    """Two pods with two keys each, one's back four times already. Counted alone, that
    pod takes no new key even once the other holds one more; with the prior (three mean
    keys each) the key more makes the first pod the spare again."""
    pods = ("a:1", "b:1")
    keys = {_key(n): 4.0 if n < 2 else 1.0 for n in range(4)}
    served = {_key(n): "a:1" if n < 2 else "b:1" for n in range(4)}
    more, served_more = keys | {_key(4): 1.0}, served | {_key(4): "b:1"}

    def spares(keys: Mapping[int, float], served: Mapping[int, str], prior: float) -> set[str]:
        table = _homes(keys, served, healthy=pods, known=set(pods), prior=prior)
        return set(table.spares)

    assert spares(keys, served, 0.0) == {"b:1"}
    assert spares(more, served_more, 0.0) == {"b:1"}
    assert spares(more, served_more, 3.0) == {"a:1"}


def test_thirty_two_keys_arriving_one_by_one_are_even_and_never_move() -> None:
    """c's shape, each key served by a spare its bucket is offered to, then pinned
    there: no pin ever changes, and no pod ends more than one key off another."""
    memory = BucketMemory()
    keys: dict[int, float] = {}
    served: dict[int, str] = {}
    table = _homes(None, None)
    for n in range(32):
        bucket = n * 7 % BUCKETS
        hashed = _key(bucket)
        keys[hashed] = 1.0
        served[hashed] = min(_offered(table).get(bucket, table.spares))
        table = _homes(keys, served, memory)
        assert all(table.memory.pins[b] == pod for b, pod in memory.pins.items())
        assert table.memory.pins[bucket] == served[hashed]
        memory = table.memory
    held = [len(table.buckets.get(pod, ())) for pod in PODS]
    assert max(held) - min(held) <= 1, held


def test_a_slack_keeps_a_pod_a_key_ahead_among_the_spares() -> None:
    """Four pods with 3/2/2/1 keys of equal weight: with no slack only the pods at or
    under their share (2 keys) take new keys; with a slack of one mean key, the pod a
    key ahead does too, and the one two keys ahead still does not."""
    held = {"a:1": 3, "b:1": 2, "c:1": 2, "d:1": 1}
    keys: dict[int, float] = {}
    served: dict[int, str] = {}
    bucket = 0
    for pod, n in held.items():
        for _ in range(n):
            keys[_key(bucket)] = 1.0
            served[_key(bucket)] = pod
            bucket += 1
    assert _homes(keys, served).spares == {"b:1", "c:1", "d:1"}
    assert _homes(keys, served, slack=1.0).spares == set(PODS)
    held_more = keys | {_key(bucket): 1.0}
    served_more = served | {_key(bucket): "a:1"}
    assert _homes(held_more, served_more, slack=1.0).spares == {"b:1", "c:1", "d:1"}


def test_a_bucket_whose_pod_is_out_of_rotation_waits_on_one_spare() -> None:
    """However wide the offers, a bucket pinned to a pod out of rotation is offered to
    one spare, the same at each decision: its keys wait together for their pod, where
    least request over several spares would send each of their requests elsewhere."""
    memory = BucketMemory(pins={3: "c:1", 7: "a:1"})
    keys = {_key(3): 4.0, _key(7): 4.0}
    wide = len(PODS) + 3

    def offered() -> dict[int, frozenset[str]]:
        return _offered(
            _homes(keys, {}, memory, healthy=("a:1", "b:1", "d:1"), width=wide, slack=100.0)
        )

    first = offered()
    assert len(first[3]) == 1 and first[3] == offered()[3]
    assert first[3] < {"a:1", "b:1", "d:1"}
    # A bucket never pinned is listed nowhere: the default subset, every spare.
    assert set(first) == {3}
