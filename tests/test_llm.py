"""LLM stage: tiny transformers engine (streaming, interleaving, cancellation), prompt trimming,
and the OpenAI-compatible backend against a local fake SSE server."""
from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from pipeline.engines import Sampling
from pipeline.llm import LLMConfig, build_prompt, make_llm
from pipeline.llm.engine import LLMEngine, LLMStream, sample_next
from pipeline.runtime.threads import InferenceThread
from pipeline.services import LLMService

torch.set_num_threads(1)

HELLO = [{"role": "user", "content": "Hello, how are you today?"}]
BOOK = [
    {"role": "user", "content": "Hi there."},
    {"role": "assistant", "content": "Hello! What can I do for you?"},
    {"role": "user", "content": "I would like to book a table for two people tomorrow."},
]


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    eng = make_llm(LLMConfig.tiny(temperature=0.0))  # greedy: comparable with generate()
    assert isinstance(eng, LLMEngine)
    eng.warmup()
    assert eng.active_requests == 0
    return eng


@pytest.fixture
def llm_thread():
    """An inference thread for a service under test."""
    thread = InferenceThread("llm-test")
    yield thread
    thread.shutdown()


def _reference(engine: LLMEngine, messages, max_output_tokens: int) -> list[int]:
    """transformers' own greedy generate on the same weights and prompt."""
    ids = torch.tensor([engine.prompt_ids(messages, max_output_tokens=max_output_tokens)])
    with torch.inference_mode():
        out = engine.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_output_tokens,  # transformers' name
            eos_token_id=sorted(engine.stop_ids),
            pad_token_id=engine.tokenizer.pad_token_id,
        )
    gen = out[0, ids.shape[1]:].tolist()
    while gen and gen[-1] in engine.stop_ids:  # generate keeps the EOS token; the engine does not
        gen.pop()
    return gen


# -- 1. greedy streaming equals transformers.generate -------------------------------------------


@pytest.mark.parametrize("messages", [HELLO, BOOK])
def test_stream_matches_greedy_generate(engine: LLMEngine, messages):
    n = engine.cfg.max_output_tokens
    stream = engine.stream(messages)
    assert engine.active_requests == 1
    deltas = list(stream)
    assert engine.active_requests == 0
    assert all(isinstance(d, str) and d for d in deltas)
    ref = _reference(engine, messages, n)
    assert stream.generated == ref
    assert "".join(deltas) == engine.decode(ref)
    # The tiny random model never says EOS on these prompts, so it must stop at max_output_tokens.
    assert len(stream.generated) == n
    assert stream.finish_reason == "length"
    with pytest.raises(StopIteration):
        next(stream)


def test_max_output_tokens_override(engine: LLMEngine):
    stream = engine.stream(HELLO, Sampling(max_output_tokens=5))
    text = "".join(stream)
    assert len(stream.generated) == 5
    assert text == engine.decode(_reference(engine, HELLO, 5))


def test_incremental_detokenization_multibyte(engine: LLMEngine):
    """Multi-byte characters split over byte-level tokens come out whole, never as U+FFFD."""
    text = "héllo, wörld € 日本語 🙂 ok"
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text) // 2  # tiny vocab: many characters span several tokens
    eos = next(iter(engine.stop_ids))
    script = iter(ids + [eos])
    stream = engine.stream(HELLO, Sampling(max_output_tokens=len(ids) + 5))
    stream._step = lambda: next(script)  # feed a fixed token sequence instead of the model
    deltas = list(stream)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    assert len(deltas) > 3
    assert stream.finish_reason == "stop"
    assert engine.active_requests == 0


def test_sampling_seeded_and_topk1_is_greedy(engine: LLMEngine):
    a = "".join(engine.stream(HELLO, Sampling(temperature=0.9), top_k=40, top_p=0.9, seed=7))
    b = "".join(engine.stream(HELLO, Sampling(temperature=0.9), top_k=40, top_p=0.9, seed=7))
    greedy = "".join(engine.stream(HELLO, Sampling(temperature=0.0)))
    assert a == b
    assert "".join(engine.stream(HELLO, Sampling(temperature=1.0), top_k=1, seed=3)) == greedy
    # top-p keeps at least one token, and p -> 0 is greedy as well
    assert "".join(engine.stream(HELLO, Sampling(temperature=1.0), top_k=0, top_p=1e-9, seed=3)) == greedy
    logits = torch.tensor([0.0, 5.0, 1.0, 4.9])
    g = torch.Generator().manual_seed(0)
    picks = {int(sample_next(logits, 1.0, 2, 1.0, g)) for _ in range(200)}
    assert picks == {1, 3}
    assert engine.active_requests == 0


def test_local_checkpoint_path_loads_like_a_real_model(tmp_path):
    """A non-tiny model goes through AutoModelForCausalLM + load_tokenizer (here a random Qwen2)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from pipeline.runtime.tokenizer import tiny_tokenizer

    tok = tiny_tokenizer()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    ))
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    eng = make_llm(LLMConfig.real(model=str(tmp_path), device="cpu", max_output_tokens=12, temperature=0.0))
    assert eng.dtype == torch.float32 and tok.eos_token_id in eng.stop_ids
    s = eng.stream(HELLO)
    text = "".join(s)
    assert s.generated == _reference(eng, HELLO, 12)
    assert text == eng.decode(s.generated)
    assert eng.active_requests == 0


# -- 2. interleaved streams -----------------------------------------------------------------------


def test_interleaved_streams_match_solo(engine: LLMEngine):
    solo_a = "".join(engine.stream(HELLO))
    solo_b = "".join(engine.stream(BOOK))
    assert solo_a != solo_b
    a, b = engine.stream(HELLO), engine.stream(BOOK)
    c = engine.stream(HELLO)
    parts = {id(a): [], id(b): [], id(c): []}
    live = [a, b, c]
    assert engine.active_requests == 3
    while live:  # round-robin, one delta at a time, all on this one thread
        for s in list(live):
            try:
                parts[id(s)].append(next(s))
            except StopIteration:
                live.remove(s)
    assert "".join(parts[id(a)]) == solo_a
    assert "".join(parts[id(b)]) == solo_b
    assert "".join(parts[id(c)]) == solo_a
    assert engine.active_requests == 0


# -- 3. cancellation ------------------------------------------------------------------------------


def test_close_midway_frees_stream(engine: LLMEngine):
    full = "".join(engine.stream(HELLO))
    s = engine.stream(HELLO)
    other = engine.stream(BOOK)
    got = next(s) + next(s)
    assert full.startswith(got)
    next(other)
    assert engine.active_requests == 2
    s.close()
    assert engine.active_requests == 1
    assert s.finish_reason == "cancelled"
    with pytest.raises(StopIteration):
        next(s)
    s.close()  # idempotent
    assert engine.active_requests == 1
    other.close()
    assert engine.active_requests == 0

    never_started = engine.stream(HELLO)
    assert engine.active_requests == 1
    never_started.close()
    assert engine.active_requests == 0

    # The freed cache is reused and reset: a new stream still gives the same text.
    assert "".join(engine.stream(HELLO)) == full


class _GatedEngine:
    """The tiny engine, its ``stream()`` held at ``gate`` (to cancel a caller while it runs)."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.entered, self.gate = threading.Event(), threading.Event()

    @property
    def active_requests(self) -> int:
        return self.engine.active_requests

    def stream(self, messages, sampling):
        self.entered.set()
        assert self.gate.wait(10)
        return self.engine.stream(messages, sampling)


def test_service_closes_abandoned_streams_on_inference_thread(engine: LLMEngine, llm_thread, monkeypatch):
    """A service stream that is abandoned (the consumer stops, is cancelled mid-stream, or is
    cancelled while the engine is still making the stream) closes the engine stream on the
    inference thread, and nothing stays active. No ``__del__`` to fall back on. Checked inside
    the event loop: ``asyncio.run``'s shutdown would close leftover generators itself."""
    closed_on: list[int] = []
    closed = threading.Event()
    close = LLMStream.close

    def recording_close(self):
        close(self)
        closed_on.append(threading.get_ident())
        closed.set()

    def assert_closed_on_inference_thread(how: str) -> None:
        assert closed_on == [llm_thread.ident], how
        assert engine.active_requests == 0, how
        closed_on.clear()

    monkeypatch.setattr(LLMStream, "close", recording_close)
    svc = LLMService(engine, llm_thread)

    async def stop_after_two():
        stream = svc.stream(HELLO)
        for _ in range(2):
            await anext(stream)
        await stream.aclose()
        # A barrier queued after the close, waited for without turning the event loop: the close
        # must have been queued by aclose() itself, not by a later garbage-collection hook.
        llm_thread.call(lambda: None)
        assert_closed_on_inference_thread("consumer stopped")

    async def cancel_midway():
        first = asyncio.Event()

        async def consume():
            async for _ in svc.stream(BOOK):
                first.set()

        task = asyncio.create_task(consume())
        await first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        llm_thread.call(lambda: None)
        assert_closed_on_inference_thread("cancelled mid-stream")

    async def cancel_while_making():
        gated = _GatedEngine(engine)
        task = asyncio.create_task(_collect(LLMService(gated, llm_thread).stream(HELLO)))
        assert await asyncio.to_thread(gated.entered.wait, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        closed.clear()
        gated.gate.set()  # the stream is made now, with no one left to consume it
        assert await asyncio.to_thread(closed.wait, 10)
        assert_closed_on_inference_thread("cancelled while the stream was being made")

    for abandon in (stop_after_two, cancel_midway, cancel_while_making):
        asyncio.run(abandon())


# -- 4. prompt building ---------------------------------------------------------------------------


def _words(messages) -> int:
    return sum(len(str(m["content"]).split()) for m in messages)


def test_build_prompt_trims_oldest_turns():
    history = []
    for i in range(6):
        history.append({"role": "user", "content": f"question {i} " + "w " * 8})  # 10 words
        history.append({"role": "assistant", "content": f"answer {i} " + "w " * 8})
    history.append({"role": "user", "content": "last question here"})  # 3 words
    out = build_prompt(history, "be brief", budget=45, count_tokens=_words)  # system: 2 words
    assert out[0] == {"role": "system", "content": "be brief"}
    assert out[-1] == history[-1]
    assert _words(out) <= 45
    # oldest turns were removed, the newest kept, in order, starting with a user turn
    assert out[1:] == history[-len(out) + 1:]
    assert out[1]["role"] == "user"
    assert len(out) == 1 + 5  # 2 + 3 + 4 * 10 = 45
    # a generous budget keeps everything
    assert build_prompt(history, "be brief", 10_000, count_tokens=_words)[1:] == history
    # an impossible budget still keeps system + the latest user turn
    tiny = build_prompt(history, "be brief", 1, count_tokens=_words)
    assert tiny == [{"role": "system", "content": "be brief"}, history[-1]]
    # an explicit system message in the history overrides the configured prompt
    custom = build_prompt([{"role": "system", "content": "custom"}] + history[-1:], "be brief", 100)
    assert custom == [{"role": "system", "content": "custom"}, history[-1]]
    # no system prompt at all
    assert build_prompt(history[-1:], None, 100) == history[-1:]


def test_engine_trims_history_to_token_budget(engine: LLMEngine):
    history = []
    for i in range(30):
        history.append({"role": "user", "content": f"Could you tell me the time, please? {i}"})
        history.append({"role": "assistant", "content": "Sure, it is half past nine in the morning."})
    history.append({"role": "user", "content": "Thanks a lot!"})
    ids = engine.prompt_ids(history)
    assert len(ids) <= engine.cfg.history_tokens
    text = engine.tokenizer.decode(ids)
    assert engine.cfg.system_prompt.split(".")[0] in text
    assert text.rstrip().endswith("Thanks a lot!<|eot_id|><|start_header_id|>assistant<|end_header_id|>")
    assert "? 0<" not in text and "? 29<" in text
    # one enormous user turn is cut from the front to fit the context
    huge = [{"role": "user", "content": "The quick brown fox jumps. " * 200 + "END"}]
    ids = engine.prompt_ids(huge)
    assert len(ids) + engine.cfg.max_output_tokens <= engine.cfg.max_context_tokens
    assert "END" in engine.tokenizer.decode(ids)
    assert len(list(engine.stream(huge))) > 0
    assert engine.active_requests == 0


# -- factory ----------------------------------------------------------------------------------------


def test_factory_backends():
    with pytest.raises(ValueError, match="unknown LLM backend"):
        make_llm(LLMConfig(backend="nope"))
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match=r"pip install \.\[gpu\]"):
            make_llm(LLMConfig(backend="vllm"))
    cfg = LLMConfig.real(max_output_tokens=7)
    assert cfg.model == "Qwen/Qwen2.5-0.5B-Instruct" and cfg.max_output_tokens == 7


def test_profile_vocabulary():
    """The LLM config speaks the STT and TTS configs' profile vocabulary; the pre-profile spelling
    model="tiny" is refused with the new one named, not taken for a checkpoint id."""
    assert [LLMConfig.tiny().profile, LLMConfig.full().profile, LLMConfig.real().profile] == ["tiny", "full", "real"]
    with pytest.raises(ValueError, match="profile must be"):
        LLMConfig(profile="small")
    with pytest.raises(ValueError, match=r"profile='tiny'"):
        LLMConfig(model="tiny")


def test_full_profile_builds_random_weights_without_a_checkpoint():
    """profile full is the tiny recipe at another shape (here shrunk to stay CPU-cheap): a random
    model built in code over the tiny tokenizer, never a checkpoint lookup."""
    eng = make_llm(LLMConfig.full(tiny_layers=1, tiny_hidden=32, tiny_heads=2, tiny_kv_heads=1,
                                  tiny_intermediate=48, device="cpu", dtype="float32", max_output_tokens=3))
    assert type(eng.model).__name__ == "LlamaForCausalLM"
    assert eng.model.config.num_hidden_layers == 1 and eng.model.config.intermediate_size == 48
    s = eng.stream(HELLO)
    "".join(s)
    assert 1 <= len(s.generated) <= 3 and eng.active_requests == 0


def test_openai_api_key_from_env(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    assert LLMConfig().openai_api_key == "sk-test"
    monkeypatch.delenv("OPENAI_API_KEY")
    assert LLMConfig().openai_api_key is None


# -- 5. OpenAI-compatible backend -------------------------------------------------------------------


class _FakeServer:
    """An OpenAI-style streaming chat endpoint on 127.0.0.1 (SSE over HTTP/1.0, close-delimited).

    ``hold_first``: the first request gets its headers and a keep-alive comment, then waits for
    ``release`` before its first token (``holding`` is set while it waits). ``error_after``: an
    error event after that many pieces, instead of the rest."""

    def __init__(self, pieces: list[str], delay_s: float = 0.0, *, hold_first: bool = False,
                 error_after: int | None = None):
        self.pieces = pieces
        self.delay_s = delay_s
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.sent = 0
        self.disconnected = threading.Event()
        self.finished = threading.Event()
        self.holding, self.release = threading.Event(), threading.Event()
        arrivals = itertools.count()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append(body)
                fake.headers.append(dict(self.headers))
                if self.path != "/v1/chat/completions":
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                try:
                    self.wfile.write(b": keep-alive\n\n")
                    if hold_first and next(arrivals) == 0:
                        fake.holding.set()
                        fake.release.wait(30)
                    for i, piece in enumerate(fake.pieces):
                        if i == error_after:
                            self.wfile.write(b'data: {"error": {"message": "overloaded"}}\n\n')
                            return
                        chunk = {
                            "id": "x",
                            "object": "chat.completion.chunk",
                            "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}],
                        }
                        if i == 0:
                            chunk["choices"][0]["delta"]["role"] = "assistant"
                        self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                        self.wfile.flush()
                        fake.sent += 1
                        if fake.delay_s:
                            time.sleep(fake.delay_s)  # the upstream's token pace, not synchronisation
                    end = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
                    self.wfile.write(f"data: {json.dumps(end)}\n\ndata: [DONE]\n\n".encode())
                    self.wfile.flush()
                    fake.finished.set()
                except (BrokenPipeError, ConnectionResetError):
                    fake.disconnected.set()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


async def _collect(deltas) -> list[str]:
    return [d async for d in deltas]


def test_openai_backend_streams_deltas_in_order():
    pieces = ["Hel", "lo", ", wör", "ld", " — 日本", "!"]
    with _FakeServer(pieces) as fake:
        eng = make_llm(LLMConfig(backend="openai", openai_url=fake.url, openai_model="m",
                                 openai_api_key="k", system_prompt="be brief", max_output_tokens=9))
        eng.warmup()

        async def go():
            stream = eng.astream(BOOK)
            deltas = [await anext(stream)]
            active = eng.active_requests
            return deltas + await _collect(stream), active

        deltas, active_while_streaming = asyncio.run(go())
        assert deltas == pieces
        assert active_while_streaming == 1 and eng.active_requests == 0
        req = fake.requests[0]
        assert req["stream"] is True and req["model"] == "m" and req["max_tokens"] == 9
        assert req["temperature"] == 0.7 and req["top_p"] == 0.9 and req["top_k"] == 50 and "seed" not in req
        assert req["messages"][0] == {"role": "system", "content": "be brief"}
        assert req["messages"][1:] == BOOK
        assert fake.headers[0]["Authorization"] == "Bearer k"
    overridden = eng.request_body(HELLO, Sampling(temperature=0.0, max_output_tokens=3), top_k=0, top_p=1.0, seed=5)
    assert overridden["max_tokens"] == 3 and overridden["temperature"] == 0.0 and overridden["seed"] == 5
    assert "top_k" not in overridden and "top_p" not in overridden
    openai = make_llm(LLMConfig(backend="openai", openai_url="https://api.openai.com/v1"))
    assert "top_k" not in openai.request_body(HELLO)  # OpenAI's API rejects the extension


def test_openai_backend_close_early():
    pieces = [f"w{i} " for i in range(200)]
    with _FakeServer(pieces, delay_s=0.01) as fake:
        eng = make_llm(LLMConfig(backend="openai", openai_url=fake.url, openai_api_key=None))

        async def close_after_three():
            stream = eng.astream(HELLO)
            got = [await anext(stream) for _ in range(3)]
            await stream.aclose()
            return got

        assert asyncio.run(close_after_three()) == pieces[:3]
        assert eng.active_requests == 0
        # the server notices the dropped connection long before it would have finished
        assert fake.disconnected.wait(5.0)
        assert not fake.finished.is_set()
        assert fake.sent < 100
        assert "Authorization" not in fake.headers[0]

        # cancelling the task that awaits the next delta drops the connection too
        fake.disconnected.clear()

        async def cancel_while_reading():
            first = asyncio.Event()

            async def consume():
                async for _ in eng.astream(HELLO):
                    first.set()

            task = asyncio.create_task(consume())
            await first.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        sent_before = fake.sent
        asyncio.run(cancel_while_reading())
        assert eng.active_requests == 0
        assert fake.disconnected.wait(5.0)
        assert fake.sent - sent_before < 100


def test_openai_backend_http_error():
    from pipeline.llm.openai_backend import OpenAIStreamError

    with _FakeServer(["x"]) as fake:
        eng = make_llm(LLMConfig(backend="openai", openai_url=fake.url.replace("/v1", "/nope")))
        with pytest.raises(OpenAIStreamError, match="HTTP 404"):
            asyncio.run(_collect(eng.astream(HELLO)))
        assert eng.active_requests == 0


def test_openai_backend_error_event():
    from pipeline.llm.openai_backend import OpenAIStreamError

    with _FakeServer(["a", "b", "c"], error_after=2) as fake:
        eng = make_llm(LLMConfig(backend="openai", openai_url=fake.url))
        got: list[str] = []

        async def go():
            async for delta in eng.astream(HELLO):
                got.append(delta)

        with pytest.raises(OpenAIStreamError, match="server error.*overloaded"):
            asyncio.run(go())
        assert got == ["a", "b"]
        assert eng.active_requests == 0


def test_slow_upstream_does_not_hold_up_other_streams(llm_thread):
    """The upstream holds one request before its first token: another stream of the same service
    still runs to its end meanwhile (a blocking read on the one inference thread would queue it
    behind the held one); released, the held stream completes too."""
    pieces = ["Sure", ", one", " moment."]
    with _FakeServer(pieces, hold_first=True) as fake:
        eng = make_llm(LLMConfig(backend="openai", openai_url=fake.url))
        svc = LLMService(eng, llm_thread)

        async def go():
            held = asyncio.create_task(_collect(svc.stream(HELLO)))
            try:
                assert await asyncio.to_thread(fake.holding.wait, 10)
                other = await asyncio.wait_for(_collect(svc.stream(BOOK)), 10)
                still_held = not held.done() and eng.active_requests == 1
            finally:
                fake.release.set()
            return other, still_held, await asyncio.wait_for(held, 10)

        other, still_held, first = asyncio.run(go())
        assert other == pieces and still_held
        assert first == pieces
        assert eng.active_requests == 0
        assert [r["messages"][-1] for r in fake.requests] == [HELLO[-1], BOOK[-1]]
