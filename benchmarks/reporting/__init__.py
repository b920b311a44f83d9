"""The pieces of `benchmarks/report.py`, one job each: `results` reads the suite's JSON / JSONL output into records,
`ratios` computes the ratios and hardware fractions the tables show, `markdown` formats cells and tables and
writes RESULTS.md, `op_tables` and `step_tables` write the sections, `document` puts them under the run's header
(and draws the tokens/s plot)."""
