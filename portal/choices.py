from django.db import models


class Role(models.TextChoices):
    MEMBER = "member", "Member"
    MANAGER = "manager", "Manager"


class Scope(models.TextChoices):
    """What a personal API token may do. ``read``: every ``GET``; ``submit``: submit and act on
    jobs, manage tokens; ``operate``: operators' writes (onboarding, account mapping). A token's
    scopes never widen what its user may do, they only narrow it."""

    READ = "read", "Read"
    SUBMIT = "submit", "Submit"
    OPERATE = "operate", "Operate"
