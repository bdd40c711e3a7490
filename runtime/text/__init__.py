"""Text in and out: prompts from packaged data sets, prompt text to token ids, stop strings on the response."""
