"""Pure training code: no prefect, no mlflow. ARCHITECTURE.md lists its packages, top to bottom."""
