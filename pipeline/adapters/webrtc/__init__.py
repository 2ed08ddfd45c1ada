"""OpenAI's Realtime interface over WebRTC (docs/webrtc.md): the peer connection and the adapter."""
