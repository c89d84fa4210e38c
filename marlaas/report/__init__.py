"""The report of a set of jobs: `numbers` (what it says), `page` (HTML, CSV, JSON) and
`charts` (SVG)."""
