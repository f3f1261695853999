"""Studies built on the model: each answers one published question with the public API
(`jalapeno`: OpenAI's Jalapeno against GB200 and GB300, as reported; `inferred`: the
Jalapeno parameters the reported ratios imply, and how well)."""
