"""What is measured about a policy: held-out generations scored and compared with the reference
(`generations`), pass@k and maj@n (`verifiable`), the guard against reward hacking and collapse (`guard`), and
the promotion decision (`promotion`)."""
