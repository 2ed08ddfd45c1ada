"""The official openai SDK on gapless's Realtime endpoint: a typed turn, the reply's audio."""
import asyncio, base64, os, sys
from openai import AsyncOpenAI

URL = os.environ.get("GAPLESS_URL", "http://127.0.0.1:8000")  # gapless's address
KEY = os.environ.get("GAPLESS_TOKEN", "x")  # its token (any string with auth: {mode: none})

async def main():
    client = AsyncOpenAI(base_url=f"{URL}/v1", api_key=KEY)
    async with client.realtime.connect(model="gapless") as conn:
        await conn.session.update(session={"type": "realtime", "instructions": "Be brief.",
                                           "audio": {"output": {"voice": "robot"}}})
        await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "Hello!"}]})
        await conn.response.create()
        audio = b""
        async for event in conn:
            if event.type == "response.output_audio.delta":
                audio += base64.b64decode(event.delta)  # pcm16, 24 kHz
            elif event.type == "response.done":
                break
        print(f"{len(audio) / 48000:.1f} s of audio")

try:
    asyncio.run(asyncio.wait_for(main(), 60))
except OSError as exc:
    sys.exit(f"cannot reach gapless at {URL}: {exc}")
