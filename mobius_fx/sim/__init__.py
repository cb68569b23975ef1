"""The simulator and the baselines it compares Mobius with, on the plan's costs and the topology's links."""
