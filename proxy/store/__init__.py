"""The run store, used by runs and the Responses API alike: the contract and its records
(:mod:`.base`), SQLite (:mod:`.sqlite`) and PostgreSQL (:mod:`.postgres`, its LISTEN
connection :mod:`.postgres_listen`), which one ``--state-db`` names (:mod:`.location`),
every call on one worker thread (:mod:`.worker`), what wakes a tail (:mod:`.wakeups`),
the run's numbered event log (:mod:`.events`), learned outcomes beside the runs
(:mod:`.outcomes`)."""
