"""LiveKit Agents' OpenAI realtime model on gapless, here without a room (in an AgentSession it
is the llm= as usual)."""
import asyncio, os, sys
import aiohttp
from livekit.agents import APIConnectionError
from livekit.agents.llm import RealtimeError
from livekit.plugins import openai

URL = os.environ.get("GAPLESS_URL", "http://127.0.0.1:8000")
KEY = os.environ.get("GAPLESS_TOKEN", "x")

async def main():
    async with aiohttp.ClientSession() as http:
        model = openai.realtime.RealtimeModel(base_url=f"{URL}/v1", api_key=KEY, model="gapless", http_session=http)
        session = model.session()
        ctx = session.chat_ctx.copy()
        ctx.add_message(role="user", content="Say hello.")
        await session.update_chat_ctx(ctx)
        reply = await session.generate_reply()
        frames = 0
        async for message in reply.message_stream:
            frames += len([frame async for frame in message.audio_stream])
        await session.aclose()
        print(f"{frames} audio frames")

try:
    asyncio.run(asyncio.wait_for(main(), 60))
except (OSError, APIConnectionError, RealtimeError) as exc:  # no server: its retries end in one of these
    sys.exit(f"cannot reach gapless at {URL}: {exc}")
