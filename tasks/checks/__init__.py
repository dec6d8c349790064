"""Checks made before any training: `preflight` (everything that can be checked without training, with
`reward_urls`: each reward served elsewhere answers a first request) and `lengths` (every row of the tables read,
their token lengths measured against the limits)."""
