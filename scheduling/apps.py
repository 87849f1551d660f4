from django.apps import AppConfig


class SchedulingConfig(AppConfig):
    name = "scheduling"
    verbose_name = "Scheduling"

    def ready(self) -> None:
        # A bad scheduler profile must stop the process at start-up, not at the first cycle.
        from scheduling.engine.policies import active_profile

        active_profile()
