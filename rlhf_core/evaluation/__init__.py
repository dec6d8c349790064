"""What is measured about a policy: held-out generations scored and compared with the reference (`generations`),
a policy evaluated as the config says, wherever it runs (`policy`), pass@k and maj@n (`verifiable`), the guard
against reward hacking and collapse and its verdict on each evaluation (`guard`), and the promotion decision
(`promotion`)."""
