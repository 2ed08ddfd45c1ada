"""Resume after a dropped connection and drain (pipeline/resume/tokens.py, keeper.py, connection.py), in
process on the real tiny engines: two registries stand for two gateway replicas sharing one store."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from pipeline.adapters.v1 import protocol as P
from pipeline.door.auth import AuthConfig, Authenticator
from pipeline.connection import Resumption, SessionRegistry, serve_connection
from pipeline.resume.keeper import Continuity
from pipeline.llm.config import LLMConfig
from tests.slow_llm import slowed
from pipeline.conversation.snapshot import Snapshot
from pipeline.resume.tokens import BAD_TOKEN, EXPIRED, TAKEN, LocalSnapshots, ResumeRefused, SnapshotStore, new_token
from pipeline.services import LocalBackends
from pipeline.adapters.v1.adapter import Session
from pipeline.session_config import SessionConfig as _SessionConfig
from pipeline.stt.config import STTConfig
from pipeline.tts.config import TTSConfig
from pipeline.engines import BOT_SPEAKER
from tests.test_session import FakeConnection, SpyBackends, _done, _fresh

FRAME = 1920  # 24 kHz samples of one Mimi frame (80 ms): the unit of the TTS context codes


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


# ---------------------------------------------------------------------------- the store and its tokens
def _put(store, sid, generation=0, principal="p", blob=b"x"):
    """Put a snapshot as a keeper does; the token that resumes it."""
    token, digest = new_token(sid, generation)
    return token if store.put(sid, generation, principal, digest, blob) else None


def test_a_token_resumes_once_for_its_principal_only():
    store = SnapshotStore()
    token = _put(store, "sess_a", principal="token:alice", blob=b"snapshot")
    sid, gen, secret = token.split(".")
    other = SnapshotStore()
    for forged in (f"{sid}.{gen}.{secret[:-1]}{'A' if secret[-1] != 'A' else 'B'}", f"{sid}.{gen}.x",
                   _put(other, "sess_a", principal="token:alice")):  # the right form, another secret
        with pytest.raises(ResumeRefused) as refused:
            store.take(forged, "token:alice")
        assert refused.value.reason == BAD_TOKEN
    for malformed in ("garbage", "", f"{sid}.x.{secret}", f"{sid}.{gen}.", token + ".x", "a" * 500):
        with pytest.raises(ResumeRefused) as refused:
            store.take(malformed, "token:alice")
        assert refused.value.reason == BAD_TOKEN
    with pytest.raises(ResumeRefused) as refused:  # another principal's credentials
        store.take(token, "token:bob")
    assert refused.value.reason == BAD_TOKEN
    assert store.take(token, "token:alice") == (b"snapshot", 1)
    with pytest.raises(ResumeRefused) as refused:  # once only
        store.take(token, "token:alice")
    assert refused.value.reason == TAKEN
    assert _put(store, "sess_a", 0, "token:alice", b"late") is None  # the replaced session cannot overwrite it
    newer = _put(store, "sess_a", 1, "token:alice", b"newer")
    assert store.take(newer, "token:alice") == (b"newer", 2)
    with pytest.raises(ResumeRefused):  # the first token, now that its session has a newer one
        store.take(token, "token:alice")


def test_snapshots_expire_a_window_after_their_session_was_last_alive():
    clock = Clock()
    store = SnapshotStore(window_s=30, clock=clock)
    kept, gone = _put(store, "sess_kept"), _put(store, "sess_gone")
    clock.t += 20
    assert store.touch(["sess_kept", "sess_never"]) == ["sess_never"]  # still connected; one it never had
    clock.t += 25  # 45 s after the put, 25 s after the touch
    assert store.take(kept, "p") == (b"x", 1)
    with pytest.raises(ResumeRefused) as refused:
        store.take(gone, "p")
    assert refused.value.reason == EXPIRED
    assert len(store) == 1


def test_the_store_is_bounded_in_entries_and_bytes():
    store = SnapshotStore(max_entries=3, max_bytes=1000, max_snapshot_bytes=600)
    tokens = [_put(store, f"sess_{n}", blob=b"x" * 100) for n in range(4)]
    assert len(store) == 3 and store.bytes == 300  # the oldest went
    with pytest.raises(ResumeRefused):
        store.take(tokens[0], "p")
    assert _put(store, "sess_big", blob=b"x" * 601) is None  # one snapshot over its own limit
    _put(store, "sess_a", blob=b"x" * 500)
    _put(store, "sess_b", blob=b"x" * 500)
    assert store.bytes <= 1000 and len(store) <= 3
    _put(store, "sess_b", blob=b"x" * 10)  # a replaced snapshot's bytes are given back
    assert store.bytes == sum(len(e.blob) for e in store._entries.values())


def test_principals_follow_credentials_through_tickets():
    a = Authenticator(AuthConfig(mode="token"), ("alice-token-" + "a" * 32, "bob-token-" + "b" * 32))
    alice = {"authorization": "Bearer alice-token-" + "a" * 32}
    bob = {"authorization": "Bearer bob-token-" + "b" * 32}
    by_alice = a.principal(alice, {})
    assert by_alice.startswith("token:") and by_alice != a.principal(bob, {})
    assert "alice" not in by_alice  # an id of the token, never the token
    ticket, _ = a.issue(for_token="alice-token-" + "a" * 32)
    assert a.principal({}, {"ticket": ticket}) == by_alice
    assert Authenticator(AuthConfig(mode="none"), ()).principal(bob, {}) == "anyone"


# ---------------------------------------------------------------------------- sessions that resume
@pytest.fixture(scope="module")
def engines():
    return slowed(LocalBackends.build(STTConfig.tiny(num_slots=4, endpoint_ms=None),
                               LLMConfig.tiny(max_output_tokens=60), TTSConfig.tiny()), 0.02)


def SessionConfig(**settings) -> _SessionConfig:
    return _SessionConfig(**{"turn_detection": "manual", "barge_in": "words", **settings})


class Replica:
    """One gateway replica's sessions over a store every replica shares."""

    def __init__(self, backends, snapshots, cfg, principal="anyone"):
        self.backends, self.cfg, self.principal = backends, cfg, principal
        self.registry = SessionRegistry(8)
        self.continuity = Continuity(snapshots, window_s=30)

    def connect(self, query: dict | None = None, principal: str | None = None):
        conn = FakeConnection()
        resumption = Resumption(self.continuity, principal or self.principal, dict(query or {}))
        conn.served = asyncio.create_task(serve_connection(conn, self.backends, self.cfg, self.registry, Session,
                                                           resumption=resumption))
        return conn

    def session(self):
        return next(iter(self.registry))


async def _ready(conn) -> dict:
    await conn.rec.wait(lambda m: m["type"] in ("session.ready", "error"), timeout=30)
    return conn.rec.msgs[0]


def _audio(conn, turn):
    return [m for m in conn.rec.turn(turn) if m["type"] == "audio"]


def test_a_dropped_session_resumes_on_another_replica_as_the_client_had_it(engines):
    """Drop mid-reply, the client having received fewer audio messages than were sent: the resumed
    conversation (on the other replica) has the same history up to what the client heard, its
    next reply's voice context holds the codes of the audio the client heard, and the turn
    numbers go on."""
    spy = SpyBackends(_fresh(engines))
    snapshots = LocalSnapshots()
    cfg = SessionConfig(pace_lead_s=0.05, context_turns=4)
    one, two = Replica(spy, snapshots, cfg), Replica(spy, snapshots, cfg)

    async def go():
        first = one.connect()
        ready = await _ready(first)
        first.inbox.put_nowait(P.client_text("Tell me a long story about trains."))
        s1 = None

        def two_clauses_out(m):  # the reply has sent the audio of two clauses: cut inside it
            return len(s1.core.replies.reply.spoken) >= 2 if s1.core.replies.reply is not None else False

        await first.rec.wait(lambda m: m["type"] == "audio", timeout=60)
        s1 = one.session()
        await first.rec.wait(two_clauses_out, timeout=60)
        first.leave()  # the link drops
        await asyncio.wait_for(first.served, 30)
        said = s1.core.shared.history.items[-1]
        heard = _audio(first, 1)[:1]  # the client got only the first audio message before the drop
        heard_samples = sum(len(m["pcm"]) // 2 for m in heard)
        tts_calls = len(spy.calls)
        second = two.connect({"resume": ready["resume_token"], "resume_turn": "1", "resume_seq": "0"})
        again = await _ready(second)
        s2 = two.session()
        resumed_items = [(i.role, i.text) for i in s2.core.shared.history.items]
        second.inbox.put_nowait(P.client_text("And then what happened?"))
        await second.rec.wait(_done(2), timeout=60)
        second.leave()
        await asyncio.wait_for(second.served, 30)
        return ready, again, said, heard_samples, resumed_items, spy.calls[tts_calls:], second

    ready, again, said, heard_samples, resumed, later_calls, second = asyncio.run(go())
    assert "resume_token" in ready and ready["resume_window_s"] == 30 and "resumed" not in ready
    assert again["session_id"] == ready["session_id"] and again["resumed"] is True and again["turn"] == 1
    assert again["resume_token"] != ready["resume_token"]  # a new token for the next drop
    # what the dropped session remembered: every clause whose audio was sent (two or more)
    assert said.role == "assistant" and len(said.clauses) >= 2
    kept = " ".join(clause for start, clause in said.clauses if start < heard_samples)
    assert resumed == [("user", "Tell me a long story about trains."), ("assistant", kept)]
    assert kept and len(kept) < len(said.text)
    # the next reply's voice context: the bot's turn as the client heard it, frame for frame
    bot = [seg for seg in later_calls[0]["context"] if seg.speaker == BOT_SPEAKER]
    assert len(bot) == 1 and bot[0].text == kept
    np.testing.assert_array_equal(bot[0].codes, said.segment.codes[: -(-heard_samples // FRAME)])
    assert [m["turn"] for m in second.rec.msgs if m["type"] == "transcript.final"] == [2]


def test_resume_is_refused_after_the_window_forged_for_another_principal_and_twice(engines):
    clock = Clock()
    snapshots = LocalSnapshots(SnapshotStore(window_s=30, clock=clock))
    cfg = SessionConfig(pace_lead_s=None)
    replica = Replica(_fresh(engines), snapshots, cfg, principal="token:alice")

    async def dropped() -> str:
        conn = replica.connect()
        ready = await _ready(conn)
        conn.inbox.put_nowait(P.client_text("Hello there."))
        await conn.rec.wait(_done(1), timeout=60)
        conn.leave()
        await asyncio.wait_for(conn.served, 30)
        return ready["resume_token"]

    async def attempt(token: str, principal: str | None = None):
        conn = replica.connect({"resume": token}, principal)
        first = await _ready(conn)
        await asyncio.wait_for(conn.served, 30) if first["type"] == "error" else None
        return conn, first

    async def go():
        out = {}
        token = await dropped()
        sid, gen, mac = token.split(".")
        out["forged"] = (await attempt(f"{sid}.{gen}.{mac[::-1]}"))[0]
        out["bob"] = (await attempt(token, "token:bob"))[0]
        both = [replica.connect({"resume": token}), replica.connect({"resume": token})]
        firsts = [await _ready(c) for c in both]
        out["twice"] = firsts
        for c in both:
            if firsts[both.index(c)]["type"] == "session.ready":
                c.leave()
            await asyncio.wait_for(c.served, 30)
        late = await dropped()
        clock.t += 31
        out["late"] = (await attempt(late))[0]
        return out

    out = asyncio.run(go())
    for name in ("forged", "bob", "late"):
        conn = out[name]
        assert [m.get("code") for m in conn.rec.msgs] == [P.E_RESUME_REFUSED], (name, conn.rec.msgs)
        assert conn.close_code == P.CLOSE_POLICY_VIOLATION
    assert "not valid" in out["forged"].rec.msgs[0]["message"]
    assert "more than 30 s ago" in out["late"].rec.msgs[0]["message"]
    kinds = sorted(m["type"] for m in out["twice"])
    assert kinds == ["error", "session.ready"]  # two at once: exactly one resumed
    assert next(m for m in out["twice"] if m["type"] == "error")["code"] == P.E_RESUME_REFUSED


def test_a_draining_replica_sends_its_sessions_to_resume_elsewhere(engines):
    """drain(): the reply playing ends at a chunk (response.done interrupted), the client gets
    going_away with its token and close 1012, and resumes on the other replica with what it had."""
    snapshots = LocalSnapshots()
    cfg = SessionConfig(pace_lead_s=0.05)
    one, two = Replica(_fresh(engines), snapshots, cfg), Replica(_fresh(engines), snapshots, cfg)

    async def go():
        conns = [one.connect() for _ in range(3)]
        readies = [await _ready(c) for c in conns]
        for c in conns:
            c.inbox.put_nowait(P.client_text("Tell me a long story about ships."))
        for c in conns:
            await c.rec.wait(lambda m: m["type"] == "audio", timeout=60)
        drained = list(one.registry)
        left = await one.registry.drain(timeout_s=10)
        for c in conns:
            await asyncio.wait_for(c.served, 10)
        resumed = []
        for c in conns:
            away = c.rec.msgs[-1]
            last = _audio(c, 1)[-1]
            again = two.connect({"resume": away["resume_token"], "resume_turn": "1", "resume_seq": str(last["seq"])})
            resumed.append((await _ready(again), again))
        histories = {s.id: [(i.role, i.text) for i in s.core.shared.history.items] for s in two.registry}
        had = {s.id: [(i.role, i.text) for i in s.core.shared.history.items] for s in drained}
        for _, again in resumed:
            again.leave()
            await asyncio.wait_for(again.served, 30)
        return conns, readies, left, resumed, histories, had

    conns, readies, left, resumed, histories, had = asyncio.run(go())
    assert left == 0 and len(one.registry) == 0
    for c, ready in zip(conns, readies):
        types = [m["type"] for m in c.rec.msgs]
        assert types[-2:] == ["response.done", "going_away"] and c.rec.msgs[-2]["interrupted"] is True
        assert c.rec.msgs[-1]["resume_token"] == ready["resume_token"]
        assert c.close_code == P.CLOSE_SERVICE_RESTART
    for (again, _), ready in zip(resumed, readies):
        assert again["type"] == "session.ready" and again["resumed"] is True
        assert again["session_id"] == ready["session_id"]
    # each resumed where its drained session stopped: the client had every audio message sent
    assert histories == had and len(had) == 3
    for history in histories.values():
        assert [role for role, _ in history] == ["user", "assistant"] and history[1][1]


def _saved_items(store: SnapshotStore, session_id: str) -> list:
    entry = store._entries.get(session_id)
    return Snapshot.loads(entry.blob).items if entry is not None else []


def test_a_replaced_store_is_filled_again_by_the_live_sessions(engines):
    """The store's replica replaced (an empty one in its place): a connected session's next touch
    finds itself unknown and puts its snapshot again, so a drop after that still resumes."""
    snapshots = LocalSnapshots()
    replica = Replica(_fresh(engines), snapshots, SessionConfig(pace_lead_s=None))
    replica.continuity = Continuity(snapshots, window_s=0.6)  # touched every 0.2 s

    async def go():
        conn = replica.connect()
        ready = await _ready(conn)
        conn.inbox.put_nowait(P.client_text("Remember the word lighthouse."))
        await conn.rec.wait(_done(1), timeout=60)
        old, deadline = snapshots.store, asyncio.get_running_loop().time() + 10
        while len(_saved_items(old, ready["session_id"])) < 2:  # the reply's snapshot is in
            assert asyncio.get_running_loop().time() < deadline, "the reply was not saved"
            await asyncio.sleep(0.05)
        snapshots.store = SnapshotStore(window_s=0.6)  # the old store and all it held are gone
        while not len(snapshots.store):
            assert asyncio.get_running_loop().time() < deadline, "the session was not put again"
            await asyncio.sleep(0.05)
        conn.leave()
        await asyncio.wait_for(conn.served, 30)
        again = replica.connect({"resume": ready["resume_token"]})
        back = await _ready(again)
        history = [(i.role, i.text) for i in replica.session().core.shared.history.items]
        again.leave()
        await asyncio.wait_for(again.served, 30)
        return back, history

    back, history = asyncio.run(go())
    assert back["type"] == "session.ready" and back["resumed"] is True, back
    assert history[0] == ("user", "Remember the word lighthouse.") and history[1][0] == "assistant"


def test_a_store_that_fails_gets_server_busy_and_nothing_else():
    """The store's replica gone (any error from it): the reconnection is told server_busy, 1013 (it
    tries again), and no session is set up; the token is not used up."""
    class Gone(LocalSnapshots):
        async def take(self, token, principal):
            raise RuntimeError("the replica is gone")

    async def go():
        registry = SessionRegistry(4)
        conn = FakeConnection()
        resumption = Resumption(Continuity(Gone(), window_s=30), "anyone", {"resume": "sess_x.0.secret"})
        await asyncio.wait_for(serve_connection(conn, None, SessionConfig(), registry, Session, resumption=resumption), 10)
        return conn, len(registry)

    conn, registered = asyncio.run(go())
    assert [m.get("code") for m in conn.rec.msgs] == [P.E_SERVER_BUSY]
    assert conn.close_code == P.CLOSE_TRY_AGAIN_LATER and registered == 0


def test_a_draining_replica_closes_realtime_sessions_with_1012(engines):
    """The Realtime endpoint has no resume step: its sessions are not kept (no token), and a
    draining replica closes them with 1012 all the same."""
    import json

    from pipeline.adapters.realtime.adapter import RealtimeSession

    class JsonConnection(FakeConnection):
        async def send(self, frame: str) -> None:
            self.events.append(json.loads(frame))
            self.rec.msgs.append({"type": "event"})

    async def go():
        registry, conn = SessionRegistry(4), JsonConnection()
        conn.events = []
        snapshots = LocalSnapshots()
        served = asyncio.create_task(serve_connection(
            conn, _fresh(engines), SessionConfig(), registry, session_class=RealtimeSession,
            resumption=Resumption(Continuity(snapshots, window_s=30), "anyone")))
        deadline = asyncio.get_running_loop().time() + 30
        while not conn.events:
            assert asyncio.get_running_loop().time() < deadline, "no session.created"
            await asyncio.sleep(0.01)
        left = await registry.drain(timeout_s=10)
        await asyncio.wait_for(served, 10)
        return conn, left, len(snapshots.store)

    conn, left, kept = asyncio.run(go())
    assert conn.events[0]["type"] == "session.created" and "resume_token" not in json.dumps(conn.events)
    assert conn.close_code == P.CLOSE_SERVICE_RESTART and left == 0 and kept == 0
