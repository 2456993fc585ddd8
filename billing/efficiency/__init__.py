"""The efficiency advisor: where the GPU money goes, and what would save it, from measured use.

``figures`` builds the SQL, ``store`` runs it, ``advice`` holds the rules, ``cli`` the command.
The package imports nothing itself, so ``infermeter --help`` stays light.
"""
