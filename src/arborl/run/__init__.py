"""A run: the step loop (controller), wiring a config into parts (assemble), the job that trains and
evaluates (job), supervised warm start (sft), its run directory (rundir) and stop requests (stopping)."""
