"""The conversation's ears: VAD, echo cancellation, Smart Turn, and the recogniser's stream of a turn."""
