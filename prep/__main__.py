from prep.cli import main

if __name__ == "__main__":  # a process that spawn starts (train-router --strategy ddp_spawn) imports this module too
    main()
