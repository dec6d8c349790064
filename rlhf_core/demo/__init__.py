"""The offline demo worlds, built from a seed with nothing downloaded: reviews to finish (`world`, `text`), their
tiny models and tokenizers (`models`), and the arithmetic world of the RLVR recipe (`arithmetic`)."""
