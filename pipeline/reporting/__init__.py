"""Reports from results: markdown tables, the report, the scoreboard, the hardware page, the plots."""
