"""A call's record as a timeline: what was said and heard, turn by turn, when each stage answered,
and every stretch of dead air with the stage it came from (docs/observability.md).

    python -m load.record SESSION_ID [--url http://127.0.0.1:8000] [--token T] [--json]
    gapless record SESSION_ID ...          (the same)

The record is fetched from ``GET /v1/sessions/{id}/record`` with the token the session was opened
with (any token for a phone call's); ``--json`` prints it as it came.
"""
from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request


def fetch(url: str, session_id: str, token: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(f"{url.rstrip('/')}/v1/sessions/{session_id}/record", headers=headers)
    with urllib.request.urlopen(request, timeout=10) as r:
        return json.loads(r.read())


def _ms(value) -> str:
    return "-" if value is None else f"{value} ms"


def timeline(rec: dict) -> str:
    """The record as lines a person reads: a turn's user line, then each reply's."""
    lines = [f"session {rec['session_id']} over {rec.get('transport', '?')}, {rec['duration_s']:.1f} s, "
             f"{len(rec['turns'])} turns" + (f" ({rec['turns_dropped']} older not kept)" if rec["turns_dropped"] else "")]
    for turn in rec["turns"]:
        at = f"{turn['at_s']:8.2f}s"
        if turn["user"] is not None and turn["spoken"]:
            lines.append(f"{at}  turn {turn['turn']}: user spoke {turn['user']!r}  (ended by {turn['ended_by']}, "
                         f"final transcript {_ms(turn['stt_final_ms'])} after the speech)")
        elif turn["user"] is not None:
            lines.append(f"{at}  turn {turn['turn']}: user typed {turn['user']!r}")
        for reply in turn["replies"]:
            t = reply["timings"]
            split = (f"voice-to-voice {_ms(reply['voice_to_voice_ms'])} = turn end {_ms(reply['turn_end_ms'])} + "
                     if reply["voice_to_voice_ms"] is not None else "after the turn's end: ")
            if reply.get("answers") and reply["answers"] != turn["user"]:
                lines.append(f"{'':10}  answering {reply['answers']!r}")
            lines.append(f"{'':10}  reply {reply['status']}{' (' + reply['reason'] + ')' if reply['reason'] else ''}: "
                         f"{split}first token {_ms(t.get('llm_first_token_ms'))}, first TTS chunk "
                         f"{_ms(t.get('tts_first_chunk_ms'))}, first audio {_ms(t.get('first_audio_ms'))}")
            lines.append(f"{'':12}said  {reply['said']!r}")
            if reply["heard"] != reply["said"]:
                lines.append(f"{'':12}heard {reply['heard']!r}")
            if reply["barge_in_ms"] is not None:
                lines.append(f"{'':12}cut by the caller's speech, its audio stopped {reply['barge_in_ms']} ms after "
                             "the speech began")
            for name in reply["tool_calls"]:
                lines.append(f"{'':12}called {name}")
            for gap in reply["gaps"]:
                lines.append(f"{'':12}DEAD AIR {gap['ms']} ms at {gap['at_ms']} ms into the reply: {gap['cause']}")
    for err in rec["errors"]:
        lines.append(f"{err['at_s']:8.2f}s  error {err['code']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "python -m load.record") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("session_id")
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--token", help="the bearer token the session was opened with")
    ap.add_argument("--json", action="store_true", help="print the record as it came")
    args = ap.parse_args(argv)
    try:
        rec = fetch(args.url, args.session_id, args.token)
    except urllib.error.HTTPError as e:
        print(f"{prog}: {e.code}: {e.read().decode(errors='replace')}", file=sys.stderr)
        return 1
    print(json.dumps(rec, indent=1) if args.json else timeline(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
