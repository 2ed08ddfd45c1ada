"""The OpenAI Agents SDK on gapless's Realtime endpoint, with a tool. The SDK sends agent_end at
every response.done, the tool call's own included: the answer after the tool comes later."""
import asyncio, os, sys
from agents import function_tool
from agents.realtime import RealtimeAgent, RealtimeRunner

URL = os.environ.get("GAPLESS_URL", "http://127.0.0.1:8000").replace("http", "ws", 1)
KEY = os.environ.get("GAPLESS_TOKEN", "x")
TOOL_CHOICE = os.environ.get("TOOL_CHOICE", "auto")  # CI: "required" (random weights never pick a tool)

@function_tool
def get_weather(city: str) -> str:
    """The weather of a city."""
    return f"It is sunny in {city}."

async def main():
    agent = RealtimeAgent(name="assistant", instructions="Be brief.", tools=[get_weather])
    runner = RealtimeRunner(agent, config={"model_settings": {"voice": "ash", "tool_choice": TOOL_CHOICE}})
    heard, after_tool, tool_ran = 0, 0, False
    async with await runner.run(model_config={"url": f"{URL}/v1/realtime", "api_key": KEY}) as session:
        await session.send_message("What is the weather in Paris?")
        async for event in session:  # audio, history, tool_start / tool_end, ...
            if event.type == "audio":
                heard += len(event.audio.data)
                after_tool += len(event.audio.data) if tool_ran else 0
            elif event.type == "tool_end":
                tool_ran = True
            elif event.type == "agent_end" and (after_tool or not tool_ran and heard):
                break  # the answer (after the tool, if it ran) has ended
    print(f"{heard / 48000:.1f} s of audio, {after_tool / 48000:.1f} s of it after the tool")

try:
    asyncio.run(asyncio.wait_for(main(), 90))
except OSError as exc:
    sys.exit(f"cannot reach gapless at {URL}: {exc}")
