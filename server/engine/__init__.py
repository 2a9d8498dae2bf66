"""The engine loop and what a run needs: clock, session, run config, runner."""
