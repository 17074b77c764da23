"""The decode pool: workers that take transferred KV into a continuous batch and stream tokens back."""
