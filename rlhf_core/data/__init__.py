"""Data: tables read and checked (`tables`), files, globs and hub names found and read (`sources`), TRL's dataset
formats turned into rows (`rows`), chat templates (`chat`), the order batches are drawn in (`batching`), and
Markdown tables whose cells show their text as it is (`markdown`)."""
