"""Input formats that collapse into Profiles (perf script, bcc, py-spy, traces, folded)."""
